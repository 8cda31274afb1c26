"""An engine's CPU KV cache allocated in shared memory from the start: no copy, no name left behind.

For an engine that allocates its whole KV cache as one int8 ``torch.zeros`` buffer and
views every layer into it, the integration runs that allocation inside a
``SegmentAllocation``: a torch function mode that answers that one call (an int8 CPU buffer
of the size the engine's KV cache config announced) with a mapping of a fresh
``ShmSegment`` instead. A new tmpfs file is all zeros, as ``torch.zeros`` promises, so
nothing is written and nothing is copied; the pages are taken as the engine writes KV into
them, exactly as with the engine's own buffer.

The segment has no name in /dev/shm except while the daemon opens it (ShmSegment), so
however the engine's processes end, nothing of the plug-in stays in /dev/shm.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ...client.shm_segment import ShmSegment
from .logs import log


class SegmentAllocation(TorchFunctionMode):
    """Inside this mode, the first ``torch.zeros(n, dtype=int8)`` on the CPU with ``n`` in
    ``sizes`` comes from a new ShmSegment (kept in ``segment``, named ``prefix``-... while
    the daemon opens it); every other call is torch's."""

    def __init__(self, sizes: set[int], prefix: str = "cachexferd-kv") -> None:
        super().__init__()
        self.sizes = sizes
        self.prefix = prefix
        self.segment: ShmSegment | None = None
        self.tensor: torch.Tensor | None = None

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and self.segment is None:
            size = _wanted_size(args, kwargs, self.sizes)
            if size is not None:
                return self._allocate(size)
        return func(*args, **kwargs)

    def _allocate(self, size: int) -> torch.Tensor:
        self.segment = ShmSegment(size, prefix=self.prefix)
        self.tensor = torch.empty(0, dtype=torch.int8).set_(self.segment.storage())
        log.info("cachexferd: the engine's KV cache (%.2f GiB) placed in shared memory", size / 2**30)
        return self.tensor


def _wanted_size(args: tuple[Any, ...], kwargs: dict[str, Any], sizes: set[int]) -> int | None:
    """The size of a ``torch.zeros`` call that is the engine's KV buffer, else None."""
    if kwargs.get("dtype") is not torch.int8 or kwargs.get("out") is not None:
        return None
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "cpu":
        return None
    shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
    if len(shape) != 1 or not isinstance(shape[0], int) or shape[0] not in sizes:
        return None
    return int(shape[0])
