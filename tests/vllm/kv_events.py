"""A router's view of vLLM's KV events: vLLM's ``KVEventBatch`` decoded from a ZeroMQ SUB socket
(imported only by tests that found vLLM)."""

from __future__ import annotations

from typing import Any


class Subscriber:
    """The hashes a router holds per medium, those it saw removed, and (with vLLM's
    ``self_describing_kv_events``) each stored block's token ids."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.held: dict[str, set[Any]] = {}
        self.removed: dict[str, set[Any]] = {}
        self.tokens: dict[Any, tuple[int, ...]] = {}  # block hash -> its token ids (when vLLM sends them)

    def drain(self) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        while self.sock.poll(50):
            _topic, _seq, payload = self.sock.recv_multipart()
            for event in self.decoder.decode(payload).events:
                medium = str(getattr(event, "medium", None))
                if isinstance(event, BlockStored):
                    self.held.setdefault(medium, set()).update(event.block_hashes)
                    self._remember_tokens(event)
                elif isinstance(event, BlockRemoved):
                    self.held.setdefault(medium, set()).difference_update(event.block_hashes)
                    self.removed.setdefault(medium, set()).update(event.block_hashes)

    def cpu(self) -> set[Any]:
        return self.held.get("CPU", set())

    def _remember_tokens(self, event: Any) -> None:
        size = int(event.block_size or 0)
        if size and len(event.token_ids) == size * len(event.block_hashes):
            for i, block_hash in enumerate(event.block_hashes):
                self.tokens[block_hash] = tuple(event.token_ids[i * size : (i + 1) * size])

    def close(self) -> None:
        self.sock.close(linger=0)
