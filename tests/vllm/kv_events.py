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
        self.seq = -1  # the last batch's sequence number

    def drain(self) -> None:
        while self.sock.poll(50):
            self._apply(*self.sock.recv_multipart())

    def replay(self, endpoint: str, timeout_s: float = 10.0) -> int:
        """What a restarted router does: every batch vLLM's publisher still keeps, from its
        replay endpoint (the first sequence number wanted; the batches come back one message
        each, then an end marker, so a DEALER rather than a REQ); returns how many."""
        import zmq

        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(endpoint)
        count = 0
        try:
            sock.send_multipart([b"", (self.seq + 1).to_bytes(8, "big")])
            while True:
                if not sock.poll(int(timeout_s * 1000)):
                    raise AssertionError(f"no replay from {endpoint} in {timeout_s}s")
                _empty, topic, seq, payload = sock.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) < 0:  # vLLM's end of the replay
                    return count
                self._apply(topic, seq, payload)
                count += 1
        finally:
            sock.close(linger=0)

    def _apply(self, _topic: bytes, seq_bytes: bytes, payload: bytes) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        seq = int.from_bytes(seq_bytes, "big")
        if seq <= self.seq:
            return  # seen already (a live batch also replayed)
        self.seq = seq
        for event in self.decoder.decode(payload).events:
            medium = str(getattr(event, "medium", None))
            if isinstance(event, BlockStored):
                self.held.setdefault(medium, set()).update(event.block_hashes)
                self._remember_tokens(event)
            elif isinstance(event, BlockRemoved):
                self.held.setdefault(medium, set()).difference_update(event.block_hashes)
                self.removed.setdefault(medium, set()).update(event.block_hashes)

    def storage(self) -> set[Any]:
        return self.held.get("STORAGE", set())

    def cpu(self) -> set[Any]:
        return self.held.get("CPU", set())

    def _remember_tokens(self, event: Any) -> None:
        size = int(event.block_size or 0)
        if size and len(event.token_ids) == size * len(event.block_hashes):
            for i, block_hash in enumerate(event.block_hashes):
                self.tokens[block_hash] = tuple(event.token_ids[i * size : (i + 1) * size])

    def close(self) -> None:
        self.sock.close(linger=0)
