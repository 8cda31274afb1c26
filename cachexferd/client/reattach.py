"""Keeping a runner's cache attached across daemon restarts, when the runner asks for it.

A restarted daemon has a new boot id, no imports and weights version 0: the runner must
attach again and put its weights version back. A ``Reattacher`` does that by itself: a
daemon thread with its own connection asks the daemon for its status every ``interval_s``
and, when the boot id changed, attaches the cache again with the runner's weights version in
the ATTACH itself, so no copy can run under version 0 in between. It never waits longer
than ``timeout_s`` per call, and a daemon that is down is just asked again at the next
interval. Stop it before detaching for good.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from .link import ClientError

if TYPE_CHECKING:
    from .runner import DeviceCacheHandle, RunnerClient

log = logging.getLogger(__name__)


class Reattacher:
    def __init__(
        self,
        endpoint: str,
        cache: DeviceCacheHandle,
        boot_id: str | None,
        weights_version: Callable[[], int | None] = lambda: None,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 5.0,
    ) -> None:
        """``boot_id``: the daemon's boot id when the cache was attached; ``weights_version``:
        the version the runner's model runs now (None: never set)."""
        self.endpoint, self.cache, self._attached_boot = endpoint, cache, boot_id
        self.weights_version = weights_version
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.reattached = 0  # attaches done after a restart
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cachexferd-reattach", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        client: RunnerClient | None = None
        boot = self._attached_boot
        while not self._stop.wait(self.interval_s):
            try:
                client = client or self._connect()
                current = str(client.status()["boot_id"])
                if boot is not None and current != boot:
                    version = self.weights_version()
                    client.attach(self.cache, weights_version=version)
                    self.reattached += 1
                    log.info("daemon at %s restarted (boot %s): cache attached again (weights version %s)",
                             self.endpoint, current, version)  # fmt: skip
                boot = current
            except ClientError as exc:  # down or restarting: ask again at the next interval
                log.debug("re-attach check at %s: %s", self.endpoint, exc)
                if client is not None:
                    client.close()
                client = None
        if client is not None:
            client.close()

    def _connect(self) -> RunnerClient:
        from .runner import RunnerClient

        return RunnerClient(self.endpoint, name="runner-reattach", timeout_s=self.timeout_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s * 2 + self.interval_s)
