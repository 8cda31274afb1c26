"""Everything the plug-in takes from vLLM, in one module, behind a version check.

vLLM's offloading interface is marked experimental and has changed in nearly every minor
release. The other modules of the plug-in import vLLM's names from here only.
vllm_names.py lists every vLLM name the plug-in uses (modules, base classes, signatures,
fields, attributes, the KV-cache allocation described at ``KV_ALLOCATION``), and api_check.py
checks that list against a vLLM source tree without importing it. A new vLLM version means:
run the check on its sources, follow each difference here (a shim below, declared in
vllm_names.HANDLED), run tests/vllm against it where it can run, and add its series to
``SUPPORTED``.

Importing this module with an unsupported vLLM raises ``UnsupportedVllmError`` with a
one-line message naming the supported versions, before any other vLLM name is touched.
``CACHEXFERD_VLLM_ANY_VERSION=1`` skips the check (for trying a new version, not for use).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import vllm

# vLLM release series (major.minor) the plug-in supports. 0.33 is checked against its
# sources only (api_check.py): its engine does not run on the CPU build the tests use.
SUPPORTED = ("0.32", "0.33")


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
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector as VllmOffloadingConnector,
)
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
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TransferResult,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.base import OffloadingWorker as VllmOffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.outputs import KVConnectorOutput

# Version shims: what differs between the supported series, found by feature, not version.

# 0.33: OffloadingManager.lock, a context manager every caller of a manager method holds
# (vLLM's scheduler enters it around its own calls; it need not be reentrant).
MANAGER_HAS_LOCK = isinstance(getattr(OffloadingManager, "lock", None), property)

# 0.33: submit_load(job_id, src_spec, dst_spec, expedited=True) for a load the step waits for
# (vLLM calls wait() on it at once).
SUBMIT_LOAD_TAKES_EXPEDITED = "expedited" in inspect.signature(VllmOffloadingWorker.submit_load).parameters


def manager_lock(manager: OffloadingManager) -> AbstractContextManager[Any]:
    """The lock to hold around a call into the manager that vLLM's scheduler does not make
    itself (0.33; a null context on 0.32). Never inside one of vLLM's own calls into the
    connector's scheduler side that holds it already, such as update_connector_output."""
    if MANAGER_HAS_LOCK:
        lock: AbstractContextManager[Any] = manager.lock
        return lock
    return contextlib.nullcontext()


class OffloadingConnector(VllmOffloadingConnector):
    """vLLM's OffloadingConnector, declining vLLM's sleep mode. Sleep frees the KV cache's
    memory and wake-up maps new memory in its place, but the daemon stays attached to the
    old: its transfers would miss the memory vLLM uses. 0.33 asks the connector class and
    then refuses ``enable_sleep_mode`` at start; 0.32 does not ask."""

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False


class OffloadingWorker(VllmOffloadingWorker):
    """vLLM's OffloadingWorker, for a subclass whose ``submit_load`` takes the 0.32 parameters
    on every supported vLLM: where vLLM passes ``expedited``, a ``submit_load`` that does not
    take it is wrapped to drop it. That is sound for a worker that sends what it is given at
    once or when vLLM waits (wait() is called right after an expedited load): the flag only
    asks not to queue the load behind others."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        submit_load = cls.__dict__.get("submit_load")
        if SUBMIT_LOAD_TAKES_EXPEDITED and submit_load is not None and not _takes_expedited(submit_load):
            cls.submit_load = _dropping_expedited(submit_load)


def _takes_expedited(func: Callable[..., Any]) -> bool:
    parameters = inspect.signature(func).parameters
    return "expedited" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _dropping_expedited(submit_load: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(submit_load)
    def submit(self: Any, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        return submit_load(self, job_id, src_spec, dst_spec)

    return submit


# Where vLLM allocates the KV cache on CPU, which the plug-in places in shared memory
# (engine/kv_memory.py): Worker.initialize_from_config runs the model runner's
# initialize_kv_cache inside the connector's get_mem_pool_context(), and
# vllm.v1.worker.utils.allocate_kv_cache makes one backing buffer with
# torch.zeros(size, dtype=torch.int8, device=cpu), of which every layer is a view.
KV_ALLOCATION = "vllm.v1.worker.utils.allocate_kv_cache: torch.zeros(size, dtype=torch.int8)"


def backing_sizes(kv_cache_config: KVCacheConfig) -> set[int]:
    """The byte sizes vLLM gives its backing KV allocation (one size: one buffer)."""
    return {int(t.size) for t in kv_cache_config.kv_cache_tensors}


def offline_engine() -> tuple[type[Any], type[Any]]:
    """vLLM's offline engine class and its sampling parameters (for bench.py), imported on
    first use: the entrypoint pulls in far more of vLLM than the plug-in needs."""
    from vllm.entrypoints.llm import LLM
    from vllm.sampling_params import SamplingParams

    return LLM, SamplingParams


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
    "MANAGER_HAS_LOCK",
    "SUBMIT_LOAD_TAKES_EXPEDITED",
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
    "manager_lock",
    "offline_engine",
    "replicated_kv",
]
