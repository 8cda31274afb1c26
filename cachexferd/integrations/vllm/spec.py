"""The OffloadingSpec vLLM loads by name: builds the scheduler-side manager and the worker."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ...client.shm_segment import ShmSegment
from ..engine.connection import DaemonConnection
from ..engine.kv_memory import SegmentAllocation
from ..engine.options import PluginOptions
from ..engine.shm_cache import KVCacheError, page_cache
from .keys import VllmKeyNames, layout_name
from .manager import CachexferdManager
from .processes import vllm_lineage
from .vllm_api import CanonicalKVCaches, OffloadingConfig, OffloadingManager, OffloadingSpec, OffloadingWorker
from .worker import CachexferdWorker, WorkerTimes

log = logging.getLogger("vllm.cachexferd")  # a child of vLLM's logger: our lines show in its log

RUNTIME_KEY = "cachexferd_runtime"  # facts the connector adds to the extra config (hash algorithm, instance)


class CachexferdOffloadingSpec(OffloadingSpec):
    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        runtime: dict[str, Any] | None = self.extra_config.get(RUNTIME_KEY)
        if runtime is None:
            raise ValueError(
                "CachexferdOffloadingSpec runs under kv_connector='CachexferdConnector' "
                "(kv_connector_module_path='cachexferd.integrations.vllm'), which reports failed "
                "transfers to vLLM's recompute path"
            )
        if self.blocks_per_chunk != 1:
            raise ValueError("cachexferd offloads vLLM blocks one by one: leave the offload block_size unset")
        self.options = PluginOptions.from_extra_config(self.extra_config, "kv_connector_extra_config")
        self.replicated = bool(runtime.get("replicated"))
        self.serve_loads = bool(runtime.get("prefix_caching", True))
        self.names = VllmKeyNames.create(
            model=self.options.model_id or config.model.name, weights_version=self.options.weights_version,
            dtype=config.model.dtype, layout=_layout(config, str(runtime.get("hash_algo", ""))),
            tokens_per_block={g.group_id: g.tokens_per_block for g in config.groups},
            tp_size=config.parallel.world_size, replicated=self.replicated,
        )  # fmt: skip
        # Stamped on every host block this vLLM instance writes, checked on every read (1.2);
        # the manager adds the epoch of its index (room left for it within the 64 characters).
        self.owner = f"vllm-{runtime.get('instance') or 'unknown'}-{self.names.space.digest[:16]}"[:52]
        self.allocation: SegmentAllocation | None = None  # set by the connector (worker side, CPU)
        self._manager: CachexferdManager | None = None
        self._worker: CachexferdWorker | None = None

    def _connection(self, endpoints: list[str], name: str, **kwargs: Any) -> DaemonConnection:
        o = self.options
        return DaemonConnection(
            endpoints, name=name, transfer_timeout_s=o.transfer_timeout_s,
            connect_timeout_s=o.connect_timeout_s, retry_interval_s=o.retry_interval_s,
            lost_after_s=o.lost_after_s, slow_after_s=4 * o.max_stall_s, **kwargs,
        )  # fmt: skip

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            endpoints = [self.options.endpoint_for(r) for r in range(self.config.parallel.world_size)]
            conn = self._connection(endpoints, "vllm-scheduler")
            if not self.serve_loads:
                log.warning("cachexferd: vLLM runs with prefix caching off (as it does for MLA models on CPUs, whose "
                            "attention cannot start from a loaded prefix): blocks are stored, not loaded")  # fmt: skip
            self._manager = CachexferdManager(self.options, self.names, conn, owner=self.owner,
                                              serve_loads=self.serve_loads,
                                              events=self.kv_events_config.enable_kv_cache_events)  # fmt: skip
            log.info("cachexferd: scheduler side up (daemons %s, storage keys %s)", endpoints, self.names.space.digest)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            rank = self.config.parallel.rank
            tensors = [t.tensor for t in kv_caches.tensors]
            segment = _checked_segment(self.allocation, tensors)
            cache = page_cache(tensors, segment, hint="is this vLLM version supported? docs/vllm.md, 'vLLM versions'")
            conn = self._connection([self.options.endpoint_for(rank)], f"vllm-worker-{rank}", cache=cache,
                                    lineage=vllm_lineage())  # fmt: skip
            times = WorkerTimes(self.options.max_stall_s, self.options.transfer_timeout_s)
            self._worker = CachexferdWorker(conn, self.names, rank, times, self.owner)
            if not conn.start():
                log.warning("cachexferd: no daemon at start: %s; vLLM serves without it until it answers, "
                            "and offloads from then on", conn.unreachable())  # fmt: skip
        return self._worker


def _layout(config: OffloadingConfig, hash_algo: str) -> str:
    """What one offloaded block holds on a worker: every KV-cache group's block is one page
    of each of vLLM's KV tensors (its groups share them), so one name covers them all."""
    tokens = sorted({g.tokens_per_block for g in config.groups})
    return layout_name(
        layers=sum(len(g.layer_names) for g in config.groups), block_bytes=config.worker_kv_bytes_per_block,
        tokens_per_block=tokens[0] if len(tokens) == 1 else 0, kv_cache_layout=config.kv_cache_layout or "",
        hash_algo=hash_algo, groups=len(config.groups),
    )  # fmt: skip


def _checked_segment(allocation: SegmentAllocation | None, tensors: list[torch.Tensor]) -> ShmSegment | None:
    """The segment vLLM's KV buffer was allocated in, checked to be the one these tensors view."""
    if allocation is None or allocation.segment is None or allocation.tensor is None:
        return None
    if {t.untyped_storage().data_ptr() for t in tensors} != {allocation.tensor.data_ptr()}:
        raise KVCacheError("vLLM's KV cache tensors are not views of the plug-in's shared-memory buffer")
    return allocation.segment
