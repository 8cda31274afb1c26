"""Everything the plug-in takes from vLLM, in one module, behind a version check.

vLLM's offloading interface is marked experimental and has changed in nearly every minor
release. The other modules of the plug-in import vLLM's names from here only, so a new
vLLM version means: read vLLM's diff of the names below (and of the KV-cache allocation
described at ``KV_ALLOCATION``), adapt this module (and what the diff breaks), run
tests/vllm against it, and add its series to ``SUPPORTED``.

Importing this module with an unsupported vLLM raises ``UnsupportedVllmError`` with a
one-line message naming the supported versions, before any other vLLM name is touched.
``CACHEXFERD_VLLM_ANY_VERSION=1`` skips the check (for trying a new version, not for use).
"""

from __future__ import annotations

import os
import re

import vllm

SUPPORTED = ("0.32",)  # vLLM release series (major.minor) the plug-in is tested with


class UnsupportedVllmError(ImportError):
    pass


def check_version(version: str) -> None:
    """Raises UnsupportedVllmError unless ``version`` is in a supported series."""
    match = re.match(r"(\d+)\.(\d+)", version)
    series = f"{match.group(1)}.{match.group(2)}" if match else version
    if series not in SUPPORTED and os.environ.get("CACHEXFERD_VLLM_ANY_VERSION") != "1":
        supported = ", ".join(f"{s}.x" for s in SUPPORTED)
        raise UnsupportedVllmError(
            f"cachexferd's vLLM plug-in supports vLLM {supported}; this is vLLM {version} "
            "(docs/vllm.md, 'vLLM versions')"
        )


VLLM_VERSION = str(getattr(vllm, "__version__", "unknown"))
check_version(VLLM_VERSION)

# ruff: noqa: E402 (the names are imported only once the version is known to fit)
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TransferResult,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.outputs import KVConnectorOutput

# Where vLLM allocates the KV cache on CPU, which the plug-in places in shared memory
# (kv_memory.py): Worker.initialize_from_config runs the model runner's
# initialize_kv_cache inside the connector's get_mem_pool_context(), and
# vllm.v1.worker.utils.allocate_kv_cache makes one backing buffer with
# torch.zeros(size, dtype=torch.int8, device=cpu), of which every layer is a view.
KV_ALLOCATION = "vllm.v1.worker.utils.allocate_kv_cache: torch.zeros(size, dtype=torch.int8)"


def backing_sizes(kv_cache_config: KVCacheConfig) -> set[int]:
    """The byte sizes vLLM gives its backing KV allocation (one size: one buffer)."""
    return {int(t.size) for t in kv_cache_config.kv_cache_tensors}


def instance_id(vllm_config: VllmConfig) -> str:
    """An id every process of one vLLM instance shares (scheduler and workers)."""
    return str(getattr(vllm_config, "instance_id", "") or "")


def replicated_kv(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> bool:
    """Whether every worker holds the same KV bytes for a block: an MLA latent under
    tensor parallelism alone (vLLM keeps a full replica per rank, ``kv_tp_replicas``)."""
    parallel = vllm_config.parallel_config
    tp = int(parallel.tensor_parallel_size)
    return (
        bool(getattr(vllm_config.model_config, "use_mla", False))
        and tp > 1
        and int(getattr(kv_cache_config, "kv_tp_replicas", 1)) == tp
        and parallel.world_size == tp
        and parallel.decode_context_parallel_size == 1
        and parallel.prefill_context_parallel_size == 1
    )


__all__ = [
    "KV_ALLOCATION",
    "SUPPORTED",
    "VLLM_VERSION",
    "CanonicalKVCaches",
    "GPULoadStoreSpec",
    "KVCacheConfig",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVConnectorTransferResults",
    "KVConnectorWorkerMetadata",
    "LoadStoreSpec",
    "LookupResult",
    "Medium",
    "OffloadKey",
    "OffloadingConfig",
    "OffloadingConnector",
    "OffloadingEvent",
    "OffloadingManager",
    "OffloadingSpec",
    "OffloadingWorker",
    "OffloadingWorkerMetadata",
    "PrepareStoreOutput",
    "ReqContext",
    "RequestOffloadingContext",
    "ScheduleEndContext",
    "TransferResult",
    "UnsupportedVllmError",
    "VllmConfig",
    "backing_sizes",
    "check_version",
    "get_offload_group_idx",
    "instance_id",
    "replicated_kv",
]
