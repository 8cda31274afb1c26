"""The plug-in's options: a ``"cachexferd"`` map inside the extra config an engine hands
its connector (each integration's docs say where its engine takes it)::

    {"cachexferd": {"endpoint": "ipc:///run/cachexferd/{rank}/cmd.sock", "storage": "write_through"}}

No engine or torch import, so the options can be parsed and checked anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ...config import default_runtime_dir

STORAGE_MODES = ("off", "write_through")


@dataclass(frozen=True)
class PluginOptions:
    # Command endpoint of the daemon of each rank; "{rank}" is replaced by the worker's rank.
    # Empty: the daemon's own default for that rank (ipc://<default runtime dir>/cmd.sock).
    endpoint: str = ""
    # Host blocks to use (0: every block of the daemon's host cache; the smallest over ranks).
    host_blocks: int = 0
    # off: host tier only; write_through: every block offloaded to the host is also written
    # to the daemon's storage, so it stays loadable after its host copy is evicted (used only
    # when the daemons have a storage backend).
    storage: str = "write_through"
    # The longest a request (or an engine step) waits on the daemon: a load not done by then
    # is recomputed, a store the engine waits for is given up, a block still being stored is
    # computed; a daemon silent that long gets no new transfers until it answers again.
    max_stall_s: float = 0.5
    # A store nobody waits for that the daemon has not finished by then counts as failed.
    transfer_timeout_s: float = 10.0
    # Bound on each blocking call to a daemon that has just answered a probe (hello, attach);
    # these calls run on the plug-in's own thread, never on the engine's.
    connect_timeout_s: float = 5.0
    # How often daemons are pinged (and a daemon that is down or refusing tried again).
    retry_interval_s: float = 1.0
    # A daemon that answers nothing for this long counts as lost (one on this host also as
    # soon as its process is gone, or it answers with a new boot id).
    lost_after_s: float = 30.0
    # Names the model in storage keys (default: the engine's model name). Instances that should
    # share stored KV must use the same id, weights version and layout.
    model_id: str = ""
    # Bump after changing the weights behind the same model id: old KV then never matches.
    weights_version: str = "0"

    def __post_init__(self) -> None:
        if self.storage not in STORAGE_MODES:
            raise ValueError(f"cachexferd.storage must be one of {STORAGE_MODES}, got {self.storage!r}")
        if type(self.host_blocks) is not int or self.host_blocks < 0:
            raise ValueError(f"cachexferd.host_blocks must be an int >= 0, got {self.host_blocks!r}")
        for name in ("max_stall_s", "transfer_timeout_s", "connect_timeout_s", "retry_interval_s", "lost_after_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"cachexferd.{name} must be a positive number, got {value!r}")
        if self.endpoint and not self.endpoint.startswith(("ipc://", "tcp://")):
            raise ValueError(f"cachexferd.endpoint must start with ipc:// or tcp://, got {self.endpoint!r}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any], where: str = "extra config") -> PluginOptions:
        """The options in ``extra["cachexferd"]``; ``where`` names ``extra`` in errors."""
        raw = extra.get("cachexferd") or {}
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}.cachexferd must be a map of options")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown cachexferd options {unknown}; known: {sorted(known)}")
        return cls(**dict(raw))

    def endpoint_for(self, rank: int) -> str:
        if self.endpoint:
            return self.endpoint.replace("{rank}", str(rank))
        return f"ipc://{default_runtime_dir(rank)}/cmd.sock"

    @property
    def uses_storage(self) -> bool:
        return self.storage != "off"
