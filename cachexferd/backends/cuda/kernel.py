"""The piece kernel: one Triton launch moves many pieces (one block of one tensor each) of
all layers between device blocks and a block-major linear side — the pinned host pool
(zero-copy, through unified addressing) or a device staging buffer. cuda_pieces.py plans
the launch; this module compiles and runs it.

Triton is imported only here, only when the cuda backend loads the kernel (``load``), and
it is optional: without it the backend keeps its other methods (a log line says so). The
kernel also runs under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors standing
in for device and pinned memory, which is how the tests check its bytes without a GPU.

Why these choices: each program of a small persistent grid walks its share of the pieces
(the grid competes with the model for SMs; writes to the host fill the link with about 8
programs, reads from it need about 32); the device tensors are found through a table of
their base addresses, so one launch covers every layer whatever the number of tensors.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .cuda_copy import StagingBatch
from .cuda_pieces import KernelArgs, PieceGeometry, kernel_args

log = logging.getLogger(__name__)

_WORD_DTYPES = {8: "int64", 4: "int32", 2: "int16", 1: "int8"}
_lock = threading.Lock()
_cache: dict[bool, Any | str] = {}  # interpreted? -> kernel, or why not


def _build() -> Any:
    import triton
    import triton.language as tl

    # Untyped on purpose: Triton reads the annotations of a kernel's arguments itself. The
    # number of pairs and the grid change from swap to swap: not specialised on, so one
    # compiled variant per direction and word size serves every swap of an attach.
    @triton.jit(do_not_specialize=["pairs", "programs"])  # type: ignore[untyped-decorator]
    def move_pieces(  # type: ignore[no-untyped-def]
        table,  # int64[T]: device address of block 0 of each tensor
        ids,  # int64[1 + 2n]: linear base address, device ids, linear ids
        pairs,
        programs,  # the grid: program g moves pieces g, g + programs, ...
        tensors,
        chunk_words,
        block_stride_words,
        linear_stride_words,
        TO_LINEAR: tl.constexpr,
        WORD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        linear_base = tl.load(ids).to(tl.pointer_type(WORD))
        lanes = tl.arange(0, BLOCK)
        for piece in range(tl.program_id(0), pairs * tensors, programs):
            pair = piece // tensors
            tensor = piece % tensors
            device_block = tl.load(ids + 1 + pair)
            linear_block = tl.load(ids + 1 + pairs + pair)
            dev = tl.load(table + tensor).to(tl.pointer_type(WORD)) + device_block * block_stride_words
            lin = linear_base + linear_block * linear_stride_words + tl.cast(tensor, tl.int64) * chunk_words
            for start in range(0, chunk_words, BLOCK):
                offsets = start + lanes
                inside = offsets < chunk_words
                if TO_LINEAR:
                    tl.store(lin + offsets, tl.load(dev + offsets, mask=inside), mask=inside)
                else:
                    tl.store(dev + offsets, tl.load(lin + offsets, mask=inside), mask=inside)

    return move_pieces


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def load() -> Any | None:
    """The compiled-on-first-use kernel, or None (and one log line) where Triton is missing."""
    interpreted = _interpreted()
    with _lock:
        if interpreted not in _cache:
            try:
                _cache[interpreted] = _build()
            except Exception as exc:  # ImportError, or a Triton that cannot build for this torch
                _cache[interpreted] = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "Triton is not usable (%s): the cuda backend copies with DMA and torch staging only "
                    "(cuda.copy_method 'kernel' falls back to 'staging')", _cache[interpreted],
                )  # fmt: skip
        kernel = _cache[interpreted]
    return None if isinstance(kernel, str) else kernel


def unavailable_reason() -> str | None:
    """Why load() returned None (after it did)."""
    reason = _cache.get(_interpreted())
    return reason if isinstance(reason, str) else None


def launch(kernel: Any, table: torch.Tensor, ids: torch.Tensor, args: KernelArgs) -> None:
    """Enqueues one launch on the current stream (``ids``: ``args.ids`` on the device)."""
    import triton.language as tl

    kernel[(args.programs,)](
        table, ids, args.pairs, args.programs, args.num_tensors, args.chunk_words, args.block_stride_words,
        args.linear_stride_words, TO_LINEAR=args.to_linear, WORD=getattr(tl, _WORD_DTYPES[args.word_bytes]),
        BLOCK=args.block, num_warps=args.warps,
    )  # fmt: skip


@dataclass(frozen=True)
class Grid:
    """Programs per launch (settings cuda.kernel_programs_d2h / _h2d)."""

    to_host: int = 8
    to_device: int = 32

    @property
    def staging(self) -> int:
        """Gathers and scatters stay on the device: the larger grid, still small."""
        return max(self.to_host, self.to_device)


class PieceMover:
    """The kernel over one attached cache: zero-copy swaps and staged ones.

    Runs on a lane's issuer thread with the lane's stream current: the id uploads and the
    staging buffers come from torch's caching allocators on that stream, so their memory is
    reused only by later work on the same stream (stream order), as in cuda_stage.py."""

    def __init__(
        self,
        kernel: Any,
        geo: PieceGeometry,
        host: torch.Tensor,
        host_block_bytes: int,
        device: torch.device,
        grid: Grid,
    ) -> None:
        """``host``: the pool's flat uint8 tensor (pinned; on CPU in tests)."""
        self.kernel, self.geo, self.grid, self.device = kernel, geo, grid, device
        self.host, self.host_block_bytes = host, host_block_bytes
        self.table = self._upload(list(geo.tensor_addrs))
        self._settle()  # the lanes' streams read the table: it must be there before their first launch
        self.launches = 0
        self.word_bytes = 0  # of the last launch (for tests and describe)

    def _upload(self, values: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor(values, dtype=torch.int64)
        if self.device.type != "cuda":
            return ids  # the interpreter reads CPU tensors
        # From pinned memory: a pageable upload would synchronise the stream first.
        return ids.pin_memory().to(self.device, non_blocking=True)

    def _settle(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def warm_up(self) -> None:
        """Compiles the kernel's variants for this cache and runs it once, reading device
        block 0 into a scratch row (nothing of the runner's is written; the swap-in variant
        runs on no pieces): a Triton that cannot compile or run here (no compiler, an
        unwritable cache directory) fails now, at attach, and not at the first swaps."""
        scratch = self._staging(1)
        self._run(kernel_args(self.geo, True, [0], scratch.data_ptr(), [0], self.host_block_bytes, 1))
        for to_linear in (True, False):
            for base in (self.host.data_ptr(), scratch.data_ptr()):
                self._run(kernel_args(self.geo, to_linear, [], base, [], self.host_block_bytes, 1))
        self._settle()
        self.launches = 0

    def _run(self, args: KernelArgs) -> None:
        launch(self.kernel, self.table, self._upload(args.ids), args)
        self.launches += 1
        self.word_bytes = args.word_bytes

    def direct(self, to_host: bool, device_ids: Sequence[int], host_ids: Sequence[int]) -> None:
        """Zero-copy: pieces straight between device blocks and the pinned pool."""
        programs = self.grid.to_host if to_host else self.grid.to_device
        base, stride = self.host.data_ptr(), self.host_block_bytes
        self._run(kernel_args(self.geo, to_host, device_ids, base, host_ids, stride, programs))

    def _staging(self, rows: int) -> torch.Tensor:
        return torch.empty((rows, self.host_block_bytes), dtype=torch.uint8, device=self.device)

    def _host_rows(self, host_block: int, count: int) -> torch.Tensor:
        start = host_block * self.host_block_bytes
        return self.host[start : start + count * self.host_block_bytes].view(count, self.host_block_bytes)

    def gather(self, batch: StagingBatch) -> None:
        """Swap-out through the copy engines: one launch gathers the blocks into a device
        buffer of host-block rows, then one plain copy per host run."""
        staging = self._staging(len(batch.device_ids))
        rows = list(range(len(batch.device_ids)))
        args = kernel_args(
            self.geo, True, batch.device_ids, staging.data_ptr(), rows, self.host_block_bytes, self.grid.staging
        )
        self._run(args)
        for run in batch.host_runs:
            self._host_rows(run.host, run.length).copy_(
                staging[run.device : run.device + run.length], non_blocking=True
            )

    def scatter(self, batch: StagingBatch) -> None:
        """Swap-in through the copy engines: one plain copy per host run into a device buffer,
        then one launch scatters its pieces to the device blocks."""
        staging = self._staging(len(batch.device_ids))
        for run in batch.host_runs:
            staging[run.device : run.device + run.length].copy_(
                self._host_rows(run.host, run.length), non_blocking=True
            )
        rows = list(range(len(batch.device_ids)))
        args = kernel_args(
            self.geo, False, batch.device_ids, staging.data_ptr(), rows, self.host_block_bytes, self.grid.staging
        )
        self._run(args)
