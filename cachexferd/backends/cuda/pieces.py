"""Planning for the cuda backend's piece kernel, in pure Python (no torch, no Triton): the
constants one attach's launches share, and the addresses a launch moves.

A *piece* is one block of one device tensor (``chunk`` bytes: one layer's K or V of one
block). A launch over ``n`` block pairs moves ``n * num_tensors`` pieces. The kernel
(cuda/kernel.py) runs a small, fixed grid of persistent programs; program ``g`` moves pieces
``g, g + G, g + 2G, ...``. Piece ``p`` is pair ``i = p // T`` and tensor ``t = p % T`` and
moves between

- the device: ``table[t] + device_ids[i] * block_stride`` (``table``: the tensors' base
  addresses, int64, uploaded once per attach), and
- a *linear* side: ``linear_base + linear_ids[i] * linear_stride + t * chunk`` — the pinned
  host pool itself (zero-copy: ``linear_ids`` are host block ids, ``linear_stride`` is a
  host block), or a device staging buffer (``linear_ids`` are its rows 0..n-1).

The ids a launch reads are one slot of the lane's id ring: ``[linear_base, device ids...,
linear ids...]`` (int64). The linear side is block-major like the host pool (a block's
tensor chunks adjacent, in tensor order), so a staging buffer's rows are host blocks and
move to the host with plain contiguous copies. All offsets are in *words*: the widest of
8/4/2/1 bytes that divides every size and address, so the kernel moves 8-byte words where
it can.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .copy_plan import element_size
from .driver import KernelLaunch

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


def kernel_launch(
    geo: PieceGeometry, table: int, to_linear: bool, linear_bases: Sequence[int], linear_stride: int
) -> KernelLaunch:
    """The constants of every launch between these tensors and a linear side whose base is
    one of ``linear_bases`` (the pool; or each staging slot), ``linear_stride`` bytes a block."""
    if linear_stride < geo.num_tensors * geo.chunk:
        raise ValueError("a linear block must hold every tensor's chunk")
    word = element_size([geo.chunk, geo.block_stride, linear_stride, *linear_bases, *geo.tensor_addrs])
    chunk_words = geo.chunk // word
    block, warps = vector_shape(chunk_words, word)
    return KernelLaunch(
        table=table,
        tensors=geo.num_tensors,
        chunk_words=chunk_words,
        block_stride_words=geo.block_stride // word,
        linear_stride_words=linear_stride // word,
        to_linear=to_linear,
        word_bytes=word,
        block=block,
        warps=warps,
    )


def piece_addresses(geo: PieceGeometry, launch: KernelLaunch, ids: Sequence[int]) -> list[tuple[int, int]]:
    """(device address, linear address) of every piece in kernel order, in bytes, for the
    id slot ``ids`` = [linear base, device ids..., linear ids...]: what the kernel computes,
    spelled out for tests."""
    pairs = (len(ids) - 1) // 2
    base, w = ids[0], launch.word_bytes
    out = []
    for p in range(pairs * launch.tensors):
        i, t = divmod(p, launch.tensors)
        dev = geo.tensor_addrs[t] + ids[1 + i] * launch.block_stride_words * w
        lin = base + (ids[1 + pairs + i] * launch.linear_stride_words + t * launch.chunk_words) * w
        out.append((dev, lin))
    return out


def program_pieces(pieces: int, programs: int, program: int) -> range:
    """The pieces one program of the persistent grid moves."""
    return range(program, pieces, programs)
