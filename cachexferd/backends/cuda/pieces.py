"""Planning for the cuda backend's copy kernel, in pure Python (no torch, no Triton): what
one launch moves, with which arguments, on how many programs.

A *piece* is one block of one device tensor (``chunk`` bytes: one layer's K or V of one
block). A swap of ``n`` blocks moves ``n * num_tensors`` pieces. The kernel (cuda_kernel.py)
runs a small, fixed grid of persistent programs; program ``g`` moves pieces ``g, g + G,
g + 2G, ...``. Piece ``p`` is pair ``i = p // T`` and tensor ``t = p % T`` and moves between

- the device: ``table[t] + device_ids[i] * block_stride`` (``table``: the tensors' base
  addresses, int64, uploaded once per attach), and
- a *linear* side: ``linear_base + linear_ids[i] * linear_stride + t * chunk`` — the pinned
  host pool itself (zero-copy: ``linear_ids`` are host block ids, ``linear_stride`` is a
  host block), or a device staging buffer (``linear_ids`` are its rows 0..n-1).

The linear side is block-major like the host pool (a block's tensor chunks adjacent, in
tensor order), so a staging buffer's rows are host blocks and move to the host with plain
contiguous copies. All offsets are in *words*: the widest of 8/4/2/1 bytes that divides
every size and address, so the kernel moves 8-byte words where it can.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .cuda_copy import element_size

_VECTOR_BYTES = 4096  # bytes one program moves per step (a 4-warp CTA: 32 bytes per thread)
MAX_PROGRAMS = 1024


@dataclass(frozen=True)
class PieceGeometry:
    """Where the pieces live: the device tensors and the size of one piece."""

    tensor_addrs: tuple[int, ...]  # device address of block 0 of each tensor
    chunk: int  # bytes of one piece
    block_stride: int  # bytes from one block of a tensor to the next (chunk for contiguous tensors)

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_addrs)


@dataclass(frozen=True)
class KernelArgs:
    """Everything one launch needs; ``ids`` is uploaded to the device as int64 and is
    ``[linear_base (bytes), device ids..., linear ids...]``."""

    ids: list[int]
    pairs: int
    num_tensors: int
    word_bytes: int
    chunk_words: int
    block_stride_words: int
    linear_stride_words: int
    to_linear: bool  # device -> linear side (swap-out, or a gather into staging)
    programs: int  # grid size
    block: int  # words per vector step (a power of two)
    warps: int

    @property
    def pieces(self) -> int:
        return self.pairs * self.num_tensors

    @property
    def nbytes(self) -> int:
        return self.pieces * self.chunk_words * self.word_bytes


def word_size(geo: PieceGeometry, linear_base: int, linear_stride: int) -> int:
    """Bytes per kernel word: divides every size and address the launch touches."""
    return element_size([geo.chunk, geo.block_stride, linear_base, linear_stride, *geo.tensor_addrs])


def grid_size(pieces: int, programs: int) -> int:
    """The persistent grid: ``programs`` (a setting), never more than there are pieces."""
    return max(1, min(programs, pieces, MAX_PROGRAMS))


def vector_shape(chunk_words: int, word_bytes: int) -> tuple[int, int]:
    """(block, warps): words per vector step, a power of two no larger than needed for one
    piece and about _VECTOR_BYTES; and the warps that move it (at least 16 bytes a thread)."""
    block = 1
    while block < chunk_words and block * word_bytes < _VECTOR_BYTES:
        block *= 2
    warps = max(1, min(4, block * word_bytes // (32 * 16)))
    return block, warps


def kernel_args(
    geo: PieceGeometry,
    to_linear: bool,
    device_ids: Sequence[int],
    linear_base: int,
    linear_ids: Sequence[int],
    linear_stride: int,
    programs: int,
) -> KernelArgs:
    """The launch that moves every piece of the given block pairs (in either direction)."""
    if len(device_ids) != len(linear_ids):
        raise ValueError("device_ids and linear_ids differ in length")
    if linear_stride < geo.num_tensors * geo.chunk:
        raise ValueError("a linear block must hold every tensor's chunk")
    word = word_size(geo, linear_base, linear_stride)
    chunk_words = geo.chunk // word
    block, warps = vector_shape(chunk_words, word)
    return KernelArgs(
        ids=[linear_base, *device_ids, *linear_ids],
        pairs=len(device_ids),
        num_tensors=geo.num_tensors,
        word_bytes=word,
        chunk_words=chunk_words,
        block_stride_words=geo.block_stride // word,
        linear_stride_words=linear_stride // word,
        to_linear=to_linear,
        programs=grid_size(len(device_ids) * geo.num_tensors, programs),
        block=block,
        warps=warps,
    )


def piece_addresses(geo: PieceGeometry, args: KernelArgs) -> list[tuple[int, int]]:
    """(device address, linear address) of every piece in kernel order, in bytes: what the
    kernel computes, spelled out for tests and for checking a plan without a GPU."""
    base, w, n = args.ids[0], args.word_bytes, args.pairs
    out = []
    for p in range(args.pieces):
        i, t = divmod(p, args.num_tensors)
        dev = geo.tensor_addrs[t] + args.ids[1 + i] * args.block_stride_words * w
        lin = base + (args.ids[1 + n + i] * args.linear_stride_words + t * args.chunk_words) * w
        out.append((dev, lin))
    return out


def program_pieces(args: KernelArgs, program: int) -> range:
    """The pieces one program of the persistent grid moves."""
    return range(program, args.pieces, args.programs)


def split_pairs(count: int, pair_bytes: int, batch_bytes: int) -> list[range]:
    """Consecutive slices of the pairs, about ``batch_bytes`` each: one launch per slice (the
    unit of cancellation and of the issuer's look-ahead, as for the other methods)."""
    step = max(1, batch_bytes // max(1, pair_bytes))
    return [range(start, min(count, start + step)) for start in range(0, count, step)]
