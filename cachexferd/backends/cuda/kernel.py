"""The piece kernel: one Triton launch moves many pieces (one block of one tensor each) of
all layers between device blocks and a block-major linear side — the pinned host pool
(zero-copy, through unified addressing) or a device staging buffer. cuda/pieces.py plans
the launches; this module compiles and launches them.

Triton is imported only here, only when the cuda backend loads the kernel (``load``), and
it is optional: without it the backend keeps DMA (a log line says so). The kernel also runs
under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU memory standing in for device and
pinned memory (fake.interpreted_launcher), which is how the tests check its bytes without a
GPU.

Launching: ``KernelRunners.prepare`` compiles each variant an attach needs and keeps
Triton's compiled kernel; a launch then calls it directly with integer addresses and an
explicit stream, without Triton's Python dispatch (argument binding, specialisation key,
cache lookup, a driver query per pointer). That entry point is not a stable Triton API, so
``prepare`` first checks it on scratch memory against known bytes; where it fails, launches
go through Triton's usual dispatch instead, and ``describe()`` says which.

Why these choices: each program of a small persistent grid walks its share of the pieces
(the grid competes with the model for SMs; writes to the host fill the link with about 8
programs, reads from it need about 32); the device tensors are found through a table of
their base addresses, so one launch covers every layer whatever the number of tensors.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from .driver import DriverError, KernelLaunch

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
                    "Triton is not usable (%s): the cuda backend copies with DMA only", _cache[interpreted]
                )  # fmt: skip
        kernel = _cache[interpreted]
    return None if isinstance(kernel, str) else kernel


def unavailable_reason() -> str | None:
    """Why load() returned None (after it did)."""
    reason = _cache.get(_interpreted())
    return reason if isinstance(reason, str) else None


class _Pointer:
    """An address as Triton's dispatch takes a pointer argument (the fallback path)."""

    def __init__(self, address: int, dtype: Any) -> None:
        self.address, self.dtype = address, dtype

    def data_ptr(self) -> int:
        return self.address


Runner = Callable[[int, int, int, int], None]  # (ids address, pairs, programs, stream)


class KernelRunners:
    """The compiled variants of one device's attaches, each with the way it is launched."""

    def __init__(self, kernel: Any, device_index: int) -> None:
        self.kernel, self.device_index = kernel, device_index
        self.runners: dict[KernelLaunch, Runner] = {}
        self.paths: dict[str, int] = {"compiled": 0, "dispatch": 0}

    def prepare(self, launch: KernelLaunch) -> None:
        if launch in self.runners:
            return
        try:
            runner, path = self._checked_runner(launch)
        except Exception as exc:  # Triton cannot compile or run it here
            raise DriverError(f"the copy kernel failed its check: {type(exc).__name__}: {exc}") from None
        self.runners[launch] = runner
        self.paths[path] += 1

    def launch(self, launch: KernelLaunch, ids: int, pairs: int, programs: int, stream: int) -> None:
        try:
            self.runners[launch](ids, pairs, programs, stream)
        except Exception as exc:
            raise DriverError(f"copy kernel launch failed: {type(exc).__name__}: {exc}") from None

    def _constants(self, launch: KernelLaunch) -> tuple[Any, ...]:
        import triton.language as tl

        word = getattr(tl, _WORD_DTYPES[launch.word_bytes])
        return (launch.tensors, launch.chunk_words, launch.block_stride_words, launch.linear_stride_words,
                launch.to_linear, word, launch.block)  # fmt: skip

    def _checked_runner(self, launch: KernelLaunch) -> tuple[Runner, str]:
        """Compiles through Triton's dispatch on scratch memory, then tries the compiled
        kernel's direct entry on the same scratch; (runner, path) of the first that moves
        the right bytes. Both checks use the scratch's table: no runner memory is touched."""
        import torch

        scratch = _Scratch(launch, torch.device("cuda", self.device_index))
        stream = torch.cuda.current_stream(scratch.device).cuda_stream
        compiled = self._dispatch(launch, scratch.table_address)(scratch.ids, 1, 1, stream)
        if not scratch.moved_right():
            raise DriverError("wrong bytes through Triton's dispatch")
        try:
            scratch.reset()
            self._direct(launch, compiled, scratch.table_address)(scratch.ids, 1, 1, stream)
            if scratch.moved_right():
                return self._direct(launch, compiled, launch.table), "compiled"
            log.warning("the compiled copy kernel moved wrong bytes when launched directly: using Triton's dispatch")
        except Exception as exc:
            log.warning("launching the compiled copy kernel directly failed (%s): using Triton's dispatch", exc)
        return self._dispatch(launch, launch.table), "dispatch"

    def _direct(self, launch: KernelLaunch, compiled: Any, table: int) -> Runner:
        constants = self._constants(launch)

        def run(ids: int, pairs: int, programs: int, stream: int) -> None:
            compiled[(programs, 1, 1)](table, ids, pairs, programs, *constants, stream=stream)

        return run

    def _dispatch(self, launch: KernelLaunch, table_address: int) -> Callable[..., Any]:
        import torch

        kernel, (tensors, chunk, block_stride, linear_stride, to_linear, word, block) = (
            self.kernel, self._constants(launch)
        )  # fmt: skip
        table = _Pointer(table_address, torch.int64)
        streams: dict[int, Any] = {}

        def run(ids: int, pairs: int, programs: int, stream: int) -> Any:
            if stream not in streams:
                streams[stream] = torch.cuda.ExternalStream(stream, device=torch.device("cuda", self.device_index))
            with torch.cuda.stream(streams[stream]):
                return kernel[(programs,)](
                    table, _Pointer(ids, torch.int64), pairs, programs, tensors, chunk, block_stride, linear_stride,
                    TO_LINEAR=to_linear, WORD=word, BLOCK=block, num_warps=launch.warps,
                )  # fmt: skip

        return run

    def describe(self) -> dict[str, Any]:
        return {"variants": len(self.runners), **self.paths}


class _Scratch:
    """Block 0 of ``launch.tensors`` scratch pieces and one linear row, on the device: a
    variant's check moves the row between them and compares bytes, touching no runner
    memory (the variant's table is replaced by the scratch's own)."""

    def __init__(self, launch: KernelLaunch, device: Any) -> None:
        import torch

        self.launch, self.device = launch, device
        size = launch.tensors * launch.piece_bytes
        self.pieces = torch.empty(size, dtype=torch.uint8, device=device)
        self.row = torch.empty(size, dtype=torch.uint8, device=device)
        addrs = [self.pieces.data_ptr() + t * launch.piece_bytes for t in range(launch.tensors)]
        self.table = torch.tensor(addrs, dtype=torch.int64, device=device)
        self.table_address = self.table.data_ptr()
        self.ids_tensor = torch.tensor([self.row.data_ptr(), 0, 0], dtype=torch.int64, device=device)
        self.ids = self.ids_tensor.data_ptr()
        self.reset()

    def reset(self) -> None:
        import torch

        gen = torch.Generator(device="cpu").manual_seed(7)
        source, target = (self.pieces, self.row) if self.launch.to_linear else (self.row, self.pieces)
        source.copy_(torch.randint(0, 256, tuple(source.shape), dtype=torch.uint8, generator=gen))
        target.zero_()
        torch.cuda.synchronize(self.device)

    def moved_right(self) -> bool:
        import torch

        torch.cuda.synchronize(self.device)
        return bool(torch.equal(self.pieces, self.row))
