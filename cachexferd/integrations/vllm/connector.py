"""``CachexferdConnector``: vLLM's OffloadingConnector with cachexferd's spec, plus the
failure reporting vLLM's offloading worker does not do.

vLLM's offloading worker asserts that every transfer succeeds. Ours always reports success
and keeps failures on the side; this connector hands them on:
- GPU blocks whose load failed go to ``get_block_ids_with_load_errors``, vLLM's hook for
  recomputing them (with ``kv_load_failure_policy="recompute"``); for a model with several
  KV-cache groups, whose block ids vLLM cannot map back to requests, the request of a
  failed load goes to ``failed_recving`` instead, and vLLM recomputes it whole;
- offload keys that were not stored (or could not be loaded) travel to the scheduler in the
  worker metadata, and the manager forgets them before vLLM completes their jobs.
"""

from __future__ import annotations

import contextlib
import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from ..engine.kv_memory import SegmentAllocation
from .manager import CachexferdManager
from .spec import RUNTIME_KEY, CachexferdOffloadingSpec
from .vllm_api import (
    KVCacheConfig,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    OffloadingConnector,
    OffloadingWorkerMetadata,
    VllmConfig,
    backing_sizes,
    instance_id,
    manager_lock,
    replicated_kv,
)
from .worker import CachexferdWorker

log = logging.getLogger("vllm.cachexferd")  # a child of vLLM's logger: our lines show in its log

SPEC_NAME = "CachexferdOffloadingSpec"
SPEC_MODULE = "cachexferd.integrations.vllm.spec"


@dataclass
class CachexferdWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's completed jobs plus the offload keys that failed on some rank."""

    failed_keys: list[bytes] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = OffloadingWorkerMetadata.aggregate(self, other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        more = other.failed_keys if isinstance(other, CachexferdWorkerMetadata) else []
        return CachexferdWorkerMetadata(merged.completed_jobs, merged.transfer_stats, [*self.failed_keys, *more])


class CachexferdConnector(OffloadingConnector):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        extra: dict[str, Any] = transfer.kv_connector_extra_config
        extra.setdefault("spec_name", SPEC_NAME)
        extra.setdefault("spec_module_path", SPEC_MODULE)
        extra[RUNTIME_KEY] = {
            "hash_algo": str(vllm_config.cache_config.prefix_caching_hash_algo),
            "instance": instance_id(vllm_config),
            "replicated": replicated_kv(vllm_config, kv_cache_config),
            "prefix_caching": bool(vllm_config.cache_config.enable_prefix_caching),
        }
        if transfer.kv_load_failure_policy != "recompute" and role == KVConnectorRole.SCHEDULER:
            log.warning("cachexferd: kv_load_failure_policy is %r: requests whose KV load fails will fail "
                        "instead of being recomputed", transfer.kv_load_failure_policy)  # fmt: skip
        super().__init__(vllm_config, role, kv_cache_config)
        self._cx_kv_cache_config = kv_cache_config
        self._cx_per_request = len(kv_cache_config.kv_cache_groups) > 1  # failures reported per request

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        """vLLM allocates its KV cache inside this: on CPU, in shared memory (engine/kv_memory.py)."""
        worker = self.connector_worker
        if worker is None or not isinstance(worker.spec, CachexferdOffloadingSpec):
            return None
        if str(getattr(self._vllm_config.device_config, "device_type", "")) != "cpu":
            return None  # GPUs: the cache is exported over CUDA IPC as vLLM allocated it
        allocation = SegmentAllocation(backing_sizes(self._cx_kv_cache_config), prefix="cachexferd-vllm")
        worker.spec.allocation = allocation
        return allocation

    # vLLM submits the previous step's stores in handle_preemptions (and in start_load_kv
    # when it did not), and the step's loads in start_load_kv: each call's jobs reach the
    # daemon as one message (CachexferdWorker.one_message).

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        with self._one_message():
            super().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        with self._one_message():
            super().start_load_kv(forward_context, **kwargs)

    def _one_message(self) -> AbstractContextManager[None]:
        worker = self._cx_worker()
        return worker.one_message() if worker is not None else contextlib.nullcontext()

    def _cx_worker(self) -> CachexferdWorker | None:
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        return worker if isinstance(worker, CachexferdWorker) else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self._cx_worker()
        invalid = worker.take_invalid_block_ids() if worker is not None else set()
        return set() if self._cx_per_request else invalid

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)  # files this step's completions
        worker = self._cx_worker()
        failed = worker.take_failed_load_reqs() if worker is not None else set()
        if self._cx_per_request:
            results.failed_recving |= failed
        return results

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        meta = super().build_connector_worker_meta()
        worker = self._cx_worker()
        failed = worker.take_failed_keys() if worker is not None else []
        if meta is None and not failed:
            return None
        base = meta or OffloadingWorkerMetadata()
        return CachexferdWorkerMetadata(base.completed_jobs, base.transfer_stats, list(failed))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, CachexferdWorkerMetadata) and meta.failed_keys:
            manager = self.scheduler.manager
            if isinstance(manager, CachexferdManager):
                with manager_lock(manager):  # vLLM 0.33's rule; vLLM takes it itself below
                    manager.mark_failed(meta.failed_keys)
        super().update_connector_output(connector_output)
