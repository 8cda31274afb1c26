"""A model-runner process for ``cachexferd demo``: owns a shared-memory KV cache filled with
known data, attaches it to its daemon, and detaches when told to (a line on stdin)."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

from .client.runner import RunnerClient, ShmKVCache
from .protocol import KVLayout

if TYPE_CHECKING:
    import torch


def known_data(layout: KVLayout, seed: int, tensor: int) -> torch.Tensor:
    """The bytes tensor ``tensor`` starts with: reproducible from (seed, tensor) alone."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + tensor)
    shape = (layout.num_blocks, layout.chunk_bytes)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


def verify_segment(name: str, layout: KVLayout, seed: int, moves: dict[int, int]) -> str:
    """'' when every device block b holds original block moves.get(b, b), else what differs."""
    import torch

    size = layout.num_tensors * layout.tensor_bytes
    storage = torch.UntypedStorage.from_file(f"/dev/shm/{name}", shared=True, nbytes=size)
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]
    expected_source = torch.tensor([moves.get(b, b) for b in range(layout.num_blocks)])
    for t in range(layout.num_tensors):
        actual = flat[t * layout.tensor_bytes : (t + 1) * layout.tensor_bytes].view(layout.num_blocks, -1)
        expected = known_data(layout, seed, t)[expected_source]
        diff = (actual != expected).any(dim=1).nonzero().flatten().tolist()
        if diff:
            return f"tensor {t}: {len(diff)} blocks differ (first {diff[:5]})"
    return ""


def main(argv: list[str]) -> int:
    import torch

    endpoint, layout_json, seed = argv[0], argv[1], int(argv[2])
    layout = KVLayout(**json.loads(layout_json))
    with ShmKVCache(layout) as cache:
        for t, tensor in enumerate(cache.tensors):
            tensor.view(torch.uint8).view(layout.num_blocks, -1).copy_(known_data(layout, seed, t))
        with RunnerClient(endpoint, name="demo-runner") as runner:
            runner.attach(cache)
            print(f"attached {cache.name}", flush=True)
            sys.stdin.readline()  # the demo writes 'detach' (or closes stdin) when done
            runner.detach()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
