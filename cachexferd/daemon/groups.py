"""A BATCH of swaps on disjoint blocks, accepted, ordered, copied and answered as a group.

An engine sends the swaps of one step together, in one BATCH envelope. Judged one by one,
each command pays for its own admission, validation, registration with the block
ordering, start, release and outcome record: tens of microseconds of Python per command
on a small host. When every swap of a BATCH would be accepted and no two of them touch the
same device or host block, those per-command steps decide nothing that the batch as a
whole does not decide, so the swaps of one direction become one ``SwapGroup``: checked
with one pass over all their ids, registered as one ordering entry (which counts as as
many commands as it holds), copied by one request to the backend, and answered with one
outcome per command, built together.

What the client sees is what the per-command path gives: each command's own outcome, in
the same EVENT_BATCH, with the same result fields. Commands of one group finish together
(they are copied together in either path); a later command that touches a block of the
group waits for the group, which is when that block's command finishes anyway. A cancel
(PAUSE, DETACH, shutdown) reaches every command of the group at once.

When any condition fails (a refusal to decide, two commands sharing a block, a barrier
holding commands, ...), ``plan`` has changed nothing and the commands take the per-command
path, which decides every outcome, error code and detail as always.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..backends.base import DeviceCache, Direction
from ..protocol import Command, MsgType, ProtocolError, SwapIn, SwapOut
from . import validate
from .jobs import Copy, Job
from .ordering import swap_access
from .request import Request

if TYPE_CHECKING:
    from .device import DeviceSlot
    from .host import HostCache
    from .pausing import Pausing

Admit = Callable[[Command], None]
_new_tuple: Any = tuple.__new__
_SWAPS = frozenset({SwapOut, SwapIn})


class SwapGroup(Request):
    """The Request of a group: its commands (one op), their in-flight keys, one job for all."""

    __slots__ = ("block_bytes", "cmds", "keys")

    def __init__(self, identity: bytes, cmds: list[Command], received: float, job: Job, block_bytes: int) -> None:
        super().__init__(identity, cmds[0], received)
        self.cmds = cmds
        self.keys = [(identity, cmd.req_id) for cmd in cmds]
        self.job, self.weight, self.block_bytes = job, len(cmds), block_bytes

    def results(self, code: int, result: dict[str, Any]) -> list[dict[str, Any]]:
        """Each command's result map, from the group's: its own block and byte counts, the
        group's times. Commands of the same size share one map (they are only encoded)."""
        if code:
            return [result] * len(self.cmds)
        started, finished, size = result["started_at"], result["finished_at"], self.block_bytes
        by_blocks: dict[int, dict[str, Any]] = {}
        results = []
        for cmd in self.cmds:
            blocks = len(cmd.device_ids)  # type: ignore[attr-defined]
            own = by_blocks.get(blocks)
            if own is None:
                own = by_blocks[blocks] = {"blocks": blocks, "bytes": blocks * size, "started_at": started,
                                           "finished_at": finished}  # fmt: skip
            results.append(own)
        return results

    def __repr__(self) -> str:
        return f"SwapGroup(op={self.op}, commands={len(self.cmds)}, first req_id={self.req_id})"


class SwapGroups:
    """Plans groups from a BATCH's commands, against the daemon's state as it is now."""

    def __init__(self, device: DeviceSlot, host: HostCache, pausing: Pausing, admit: Admit) -> None:
        self.device, self.host, self.pausing, self._admit = device, host, pausing, admit

    def plan(self, identity: bytes, cmds: list[Command], received: float) -> list[SwapGroup] | None:
        """One group per swap direction in ``cmds``, their host blocks stamped; or None, with
        nothing changed, when the per-command path must judge them."""
        if not {type(cmd) for cmd in cmds} <= _SWAPS:
            return None
        try:
            cache, host_blocks = self._check_state(cmds)
        except ProtocolError:
            return None
        outs = [cmd for cmd in cmds if cmd.TYPE is MsgType.SWAP_OUT]
        ins = [cmd for cmd in cmds if cmd.TYPE is MsgType.SWAP_IN] if len(outs) < len(cmds) else []
        out_ids, in_ids = _pairs(outs), _pairs(ins)
        if out_ids is None or in_ids is None or not _fit(out_ids, in_ids, cache.layout.num_blocks, host_blocks):
            return None
        if not _keys_fit(cmds) or not self._current(ins, in_ids[1]):
            return None
        succeeded = self._stamp(outs, out_ids[1]) if outs else None
        return [_group(identity, cache, part, ids, direction, received, succeeded if part is outs else None)
                for part, ids, direction in ((outs, out_ids, Direction.D2H), (ins, in_ids, Direction.H2D))
                if part]  # fmt: skip

    def _check_state(self, cmds: list[Command]) -> tuple[DeviceCache, int]:
        """What every swap's admission and handler check before its ids: the same order, the
        same errors (which send the batch to the per-command path). Returns the attached
        cache and the number of host blocks."""
        admit = self._admit
        for cmd in cmds:
            admit(cmd)
        self.pausing.require_running()
        for cmd in cmds:
            not_after = cmd.not_after  # type: ignore[attr-defined]
            if not_after is not None:
                validate.require_in_time(not_after)
        cache = self.device.require()
        return cache, self.host.require_geometry().num_blocks

    def _current(self, ins: list[Command], host_ids: list[int]) -> bool:
        """The blocks SWAP_INs read hold the current weights and, where named, their owner's KV."""
        if not ins:
            return True
        owners = {cmd.owner for cmd in ins}  # type: ignore[attr-defined]
        keyed = any(cmd.keys is not None for cmd in ins)  # type: ignore[attr-defined]
        try:
            if len(owners) == 1 and not keyed:
                self.host.check_current(host_ids, owners.pop())
            else:
                for cmd in ins:
                    self.host.check_current(cmd.host_ids, cmd.owner, cmd.keys)  # type: ignore[attr-defined]
        except ProtocolError:
            return False
        return True

    def _stamp(self, outs: list[Command], host_ids: list[int]) -> Callable[[], None] | None:
        """Stamps the written blocks; returns what sets their identity keys once copied (1.3)."""
        owners = {cmd.owner for cmd in outs}  # type: ignore[attr-defined]
        keyed = any(cmd.keys for cmd in outs)  # type: ignore[attr-defined]
        if len(owners) == 1 and not keyed:
            self.host.stamp(host_ids, owners.pop())
            return None
        settlers = []
        for cmd in outs:
            serial = self.host.stamp(cmd.host_ids, cmd.owner)  # type: ignore[attr-defined]
            if cmd.keys:  # type: ignore[attr-defined]
                settlers.append(self.host.keys.settler(cmd.host_ids, cmd.keys, serial))  # type: ignore[attr-defined]
        if not settlers:
            return None

        def succeeded() -> None:
            for settle in settlers:
                settle()

        return succeeded


def _group(
    identity: bytes, cache: DeviceCache, cmds: list[Command], ids: tuple[list[int], list[int]], direction: Direction,
    received: float, succeeded: Callable[[], None] | None = None,
) -> SwapGroup:  # fmt: skip
    device_ids, host_ids = ids
    copy = _new_tuple(Copy, (cache, direction, device_ids, host_ids))
    to_host = direction is Direction.D2H
    access = swap_access(device_ids, host_ids, to_host)
    # Swaps never start after their not_after (1.5): the group's copy, after the earliest.
    limits = [cmd.not_after for cmd in cmds if cmd.not_after is not None]  # type: ignore[attr-defined]
    job: Job = _new_tuple(Job, (access, None, copy, succeeded, min(limits, default=math.inf)))
    return SwapGroup(identity, cmds, received, job, cache.layout.host_block_bytes)


def _fit(
    out_ids: tuple[list[int], list[int]], in_ids: tuple[list[int], list[int]], device_blocks: int, host_blocks: int
) -> bool:
    """Every id in range, and no device or host block named twice in the whole batch."""
    device, host = out_ids[0] + in_ids[0], out_ids[1] + in_ids[1]
    if not device:
        return True
    return (
        min(device) >= 0 and max(device) < device_blocks and min(host) >= 0 and max(host) < host_blocks
        and len(set(device)) == len(device) and len(set(host)) == len(host)
    )  # fmt: skip


def _keys_fit(cmds: Sequence[Command]) -> bool:
    """Every command's identity keys (1.3), if any, one per host block (else the per-command
    path gives LENGTH_MISMATCH)."""
    return all(cmd.keys is None or len(cmd.keys) == len(cmd.host_ids) for cmd in cmds)  # type: ignore[attr-defined]


def _pairs(cmds: Sequence[Command]) -> tuple[list[int], list[int]] | None:
    """All device ids and all host ids of ``cmds``, in order; None when a command's two lists
    differ in length (LENGTH_MISMATCH is the per-command path's to give)."""
    device = [i for cmd in cmds for i in cmd.device_ids]  # type: ignore[attr-defined]
    host = [i for cmd in cmds for i in cmd.host_ids]  # type: ignore[attr-defined]
    if any(len(cmd.device_ids) != len(cmd.host_ids) for cmd in cmds):  # type: ignore[attr-defined]
        return None
    return device, host
