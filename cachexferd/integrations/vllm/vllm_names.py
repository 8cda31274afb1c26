"""Every vLLM name the plug-in uses, as data: what api_check.py verifies in a vLLM source tree.

Nothing imports this at run time except the check; vllm_api.py is the one module that imports
the names themselves. Each ``Use`` names a module (``vllm.v1.kv_offload.base``) and a name in it
(``OffloadingManager.lookup``), a kind of fact and its value in the vLLM the plug-in was written
against (0.32):

- ``binds``: the module defines or imports the name (``from module import name`` works);
- ``bases``: a class's base classes, as written;
- ``methods``: the public methods a class defines, sorted, abstract ones marked ``*`` (for the
  classes the plug-in subclasses: a new hook is inherited with vLLM's default, a new abstract
  method would have to be written);
- ``signature``: a function's parameters (names, kinds, defaults; no annotations), after the
  decorators that change how it is called;
- ``fields``: a dataclass's fields in order, with defaults (the plug-in constructs it);
- ``attribute``: the class has the attribute (in its body, as a property, or set on ``self``);
- ``calls``: the calls a function makes to ``callee``, as source.

``HANDLED`` declares, per vLLM series, the values that differ from that on purpose: the plug-in
follows the difference (in vllm_api.py), and ``how`` says where. The check fails on any other
difference, so a new vLLM cannot be supported by changing the version string alone.
"""

from __future__ import annotations

from dataclasses import dataclass

ABSENT = "absent"  # the value of a name the tree does not have


@dataclass(frozen=True)
class Use:
    name: str  # "module:Qualified.name"; "module:" alone for the module itself
    kind: str
    value: str  # as api_check describes it in the vLLM the plug-in was written against
    why: str  # where the plug-in uses it
    callee: str = ""  # for kind "calls"
    override: str = ""  # "file.py:Class" of the plug-in that overrides this method (kind "signature")

    @property
    def module(self) -> str:
        return self.name.split(":")[0]

    @property
    def qualname(self) -> str:
        return self.name.split(":")[1]

    @property
    def key(self) -> str:
        return f"{self.name} {self.kind}"


@dataclass(frozen=True)
class Handled:
    value: str  # the value in that vLLM series
    how: str  # how the plug-in follows it
    drops: tuple[str, ...] = ()  # keyword arguments a vllm_api shim takes away before the override sees them


MANAGER_CLASS = "manager.py:CachexferdManager"
WORKER_CLASS = "worker.py:CachexferdWorker"
CONNECTOR_CLASS = "connector.py:CachexferdConnector"
CONNECTOR_V1 = "vllm.distributed.kv_transfer.kv_connector.v1"
OFFLOADING = f"{CONNECTOR_V1}.offloading"
CONNECTOR = f"{CONNECTOR_V1}.offloading_connector"
KV_OFFLOAD = "vllm.v1.kv_offload.base"
KV_OFFLOAD_CONFIG = "vllm.v1.kv_offload.config"

MANAGER_METHODS = (
    "complete_load, complete_store, get_load_source, get_stats, has_pending_work, lookup*, on_new_request*, "
    "on_request_finished, on_schedule_end, prepare_load*, prepare_store*, reset_cache, shutdown, take_events, touch"
)
SPEC_METHODS = "build_metric_definitions, get_manager*, get_worker*"
WORKER_METHODS = "get_finished*, shutdown, submit_load*, submit_store*, wait*"
CONNECTOR_METHODS = (
    "build_connector_meta, build_connector_worker_meta, build_kv_connector_stats, build_prom_metrics, "
    "get_external_cache_hit_sources, get_finished, get_kv_connector_stats, get_num_new_matched_tokens, "
    "get_required_kvcache_layout, handle_preemptions, has_pending_push_work, on_new_request, register_kv_caches, "
    "request_finished, request_finished_all_groups, requires_kv_delivery, reset_cache, save_kv_layer, scheduler, "
    "shutdown, start_load_kv, take_events, update_connector_output, update_state_after_alloc, wait_for_layer_load, "
    "wait_for_save"
)
CONNECTOR_BASE_METHODS = (
    "bind_connector_metadata, bind_gpu_block_pool, bind_kv_cache_manager, build_connector_meta*, "
    "build_connector_worker_meta, build_kv_connector_stats, build_prom_metrics, clear_connector_metadata, "
    "finish_forward, get_block_ids_with_load_errors, get_external_cache_hit_sources, get_finished, "
    "get_finished_count, get_handshake_metadata, get_kv_connector_kv_cache_events, get_kv_connector_stats, "
    "get_loaded_kv_cache_group_ids, get_mem_pool_context, get_num_new_matched_tokens*, get_required_kvcache_layout, "
    "get_transfer_results, handle_preemptions, has_connector_metadata, has_pending_block_frees, "
    "has_pending_push_work, on_new_request, register_finished_partial_tail, register_kv_caches, request_finished, "
    "requires_kv_delivery, requires_piecewise_for_cudagraph, reset_cache, reset_capture_state, role, "
    "save_kv_layer*, set_host_xfer_buffer_ops, set_xfer_handshake_metadata, set_xfer_handshake_metadata_pp_aware, "
    "shutdown, start_load_kv*, supports_divergent_local_hybrid_hits, take_events, update_connector_output, "
    "update_state_after_alloc*, wait_for_layer_load*, wait_for_save*"
)

IMPORTS = [
    Use(f"{module}:{name}", "binds", "present", "vllm_api.py imports it")
    for module, names in [
        ("vllm", ["__version__"]),
        ("vllm.config", ["VllmConfig"]),
        (f"{CONNECTOR_V1}.base", ["KVConnectorRole", "KVConnectorTransferResults", "KVConnectorWorkerMetadata"]),
        (f"{OFFLOADING}.common", ["OffloadingWorkerMetadata"]),
        (CONNECTOR, ["OffloadingConnector"]),
        ("vllm.v1.kv_cache_interface", ["KVCacheConfig"]),
        (
            KV_OFFLOAD,
            [
                "CanonicalKVCaches",
                "GPULoadStoreSpec",
                "LoadStoreSpec",
                "LookupResult",
                "Medium",
                "OffloadingEvent",
                "OffloadingManager",
                "OffloadingSpec",
                "OffloadingWorker",
                "OffloadKey",
                "PrepareStoreOutput",
                "ReqContext",
                "RequestOffloadingContext",
                "ScheduleEndContext",
                "TransferResult",
                "get_offload_group_idx",
            ],
        ),
        (KV_OFFLOAD_CONFIG, ["OffloadingConfig"]),
        ("vllm.v1.outputs", ["KVConnectorOutput"]),
    ]
    for name in names
]

SPEC = [
    Use(f"{KV_OFFLOAD}:OffloadingSpec", "bases", "ABC", "spec.py subclasses it"),
    Use(f"{KV_OFFLOAD}:OffloadingSpec", "methods", SPEC_METHODS, "spec.py subclasses it"),
    Use(
        f"{KV_OFFLOAD}:OffloadingSpec.__init__",
        "signature",
        "(self, config)",
        "spec.py overrides it and calls it",
        override="spec.py:CachexferdOffloadingSpec",
    ),
    Use(
        f"{KV_OFFLOAD}:OffloadingSpec.get_manager",
        "signature",
        "@abstractmethod (self)",
        "spec.py overrides it",
        override="spec.py:CachexferdOffloadingSpec",
    ),
    Use(
        f"{KV_OFFLOAD}:OffloadingSpec.get_worker",
        "signature",
        "@abstractmethod (self, kv_caches)",
        "spec.py overrides it",
        override="spec.py:CachexferdOffloadingSpec",
    ),
    *(
        Use(f"{KV_OFFLOAD}:OffloadingSpec.{a}", "attribute", "present", "spec.py reads self.<it>")
        for a in ("config", "extra_config", "blocks_per_chunk")
    ),
    *(
        Use(f"{KV_OFFLOAD_CONFIG}:{c}.{a}", "attribute", "present", "spec.py reads config.<it>")
        for c, attrs in [
            ("OffloadingConfig", ["groups", "worker_kv_bytes_per_block", "kv_cache_layout", "model", "parallel"]),
            ("OffloadingGroupConfig", ["layer_names", "tokens_per_block", "group_id"]),
            ("OffloadingModelConfig", ["name", "dtype"]),
            ("OffloadingParallelConfig", ["world_size", "rank"]),
        ]
        for a in attrs
    ),
    Use(f"{KV_OFFLOAD}:OffloadingSpec.kv_events_config", "attribute", "present", "spec.get_manager: events on"),
    Use(f"{KV_OFFLOAD}:OffloadingKVEventsConfig.enable_kv_cache_events", "attribute", "present", "spec.get_manager"),
    Use(f"{KV_OFFLOAD}:CanonicalKVCaches.tensors", "attribute", "present", "spec.get_worker"),
    Use(f"{KV_OFFLOAD}:CanonicalKVCacheTensor.tensor", "attribute", "present", "spec.get_worker"),
]

MANAGER = [
    Use(f"{KV_OFFLOAD}:OffloadingManager", "bases", "ABC", "manager.py subclasses it"),
    Use(f"{KV_OFFLOAD}:OffloadingManager", "methods", MANAGER_METHODS, "manager.py subclasses it"),
    *(
        Use(f"{KV_OFFLOAD}:OffloadingManager.{m}", "signature", sig, "manager.py overrides it", override=MANAGER_CLASS)
        for m, sig in [
            ("on_new_request", "@abstractmethod (self, req_context)"),
            ("lookup", "@abstractmethod (self, key, req_context)"),
            ("on_request_finished", "(self, req_context)"),
            ("on_schedule_end", "(self, context)"),
            ("has_pending_work", "(self)"),
            ("prepare_load", "@abstractmethod (self, keys, req_context)"),
            ("touch", "(self, keys, req_context)"),
            ("complete_load", "(self, keys, req_context)"),
            ("prepare_store", "@abstractmethod (self, keys, req_context)"),
            ("complete_store", "(self, keys, req_context, success=True)"),
            ("reset_cache", "(self)"),
            ("shutdown", "(self)"),
            ("take_events", "(self)"),
        ]
    ),
    Use(
        f"{KV_OFFLOAD}:OffloadingEvent",
        "fields",
        "keys, medium, removed, locality=None, ownership=None, removal_expected=False",
        "events.TierEvents constructs it",
    ),
    *(Use(f"{KV_OFFLOAD}:Medium.{m}", "attribute", "present", "events.py names the tiers") for m in ("CPU", "STORAGE")),
    # 0.33 makes every caller hold the manager's lock (vllm_api.manager_lock).
    Use(f"{KV_OFFLOAD}:OffloadingManager.lock", "signature", ABSENT, "vllm_api.manager_lock"),
    Use(f"{KV_OFFLOAD}:LookupResult", "bases", "Enum", "manager.lookup returns it"),
    *(
        Use(f"{KV_OFFLOAD}:LookupResult.{m}", "attribute", "present", "manager.lookup returns it")
        for m in ("MISS", "HIT", "HIT_PENDING", "RETRY")
    ),
    Use(f"{KV_OFFLOAD}:ReqContext.req_id", "attribute", "present", "manager.py reads it"),
    Use(f"{KV_OFFLOAD}:ReqContext.get_state", "signature", "(self, cls)", "manager._chains"),
    Use(f"{KV_OFFLOAD}:ReqContext.set_state", "signature", "(self, val)", "manager._chains"),
    Use(
        f"{KV_OFFLOAD}:RequestOffloadingContext",
        "fields",
        "policy=OffloadPolicy.CHUNK_LEVEL",
        "manager.on_new_request constructs it with the default policy",
    ),
    Use(
        f"{KV_OFFLOAD}:PrepareStoreOutput",
        "fields",
        "keys_to_store, store_spec, evicted_keys",
        "manager.prepare_store constructs it",
    ),
    Use(f"{KV_OFFLOAD}:get_offload_group_idx", "signature", "(key)", "manager.prepare_store"),
    Use(f"{KV_OFFLOAD}:LoadStoreSpec", "bases", "", "transfer_specs.py subclasses it"),
    Use(f"{KV_OFFLOAD}:LoadStoreSpec", "methods", "", "transfer_specs.py subclasses it"),
]

WORKER = [
    Use(f"{KV_OFFLOAD}:OffloadingWorker", "bases", "ABC", "worker.py subclasses it"),
    Use(f"{KV_OFFLOAD}:OffloadingWorker", "methods", WORKER_METHODS, "worker.py subclasses it"),
    *(
        Use(f"{KV_OFFLOAD}:OffloadingWorker.{m}", "signature", sig, "worker.py overrides it", override=WORKER_CLASS)
        for m, sig in [
            ("submit_store", "@abstractmethod (self, job_id, src_spec, dst_spec)"),
            ("submit_load", "@abstractmethod (self, job_id, src_spec, dst_spec)"),
            ("get_finished", "@abstractmethod (self)"),
            ("wait", "@abstractmethod (self, job_ids)"),
            ("shutdown", "(self)"),
        ]
    ),
    Use(
        f"{KV_OFFLOAD}:TransferResult",
        "fields",
        "job_id, success, transfer_size=None, transfer_time=None",
        "worker._finish constructs it",
    ),
    Use(f"{KV_OFFLOAD}:BlockIDsLoadStoreSpec.block_ids", "attribute", "present", "worker.py reads it"),
    Use(f"{KV_OFFLOAD}:GPULoadStoreSpec", "bases", "BlockIDsLoadStoreSpec", "worker.py reads block_ids"),
]

CONNECTOR_USES = [
    Use(f"{CONNECTOR}:OffloadingConnector", "bases", "KVConnectorBase_V1, SupportsHMA", "connector.py subclasses it"),
    # A method vLLM moves into OffloadingConnector (say, get_block_ids_with_load_errors) would
    # be one the plug-in's override now hides.
    Use(f"{CONNECTOR}:OffloadingConnector", "methods", CONNECTOR_METHODS, "connector.py subclasses it"),
    Use(
        f"{CONNECTOR}:OffloadingConnector.__init__",
        "signature",
        "(self, vllm_config, role, kv_cache_config)",
        "connector.py calls super().__init__",
        override=CONNECTOR_CLASS,
    ),
    *(
        Use(
            f"{CONNECTOR}:OffloadingConnector.{m}",
            "signature",
            sig,
            "connector.py overrides it",
            override=CONNECTOR_CLASS,
        )
        for m, sig in [
            ("handle_preemptions", "(self, kv_connector_metadata)"),
            ("start_load_kv", "(self, forward_context, **kwargs)"),
            ("build_connector_worker_meta", "(self)"),
            ("update_connector_output", "(self, connector_output)"),
        ]
    ),
    Use(f"{CONNECTOR}:OffloadingConnector.scheduler", "signature", "@property (self)", "connector.py reads it"),
    *(
        Use(f"{CONNECTOR}:OffloadingConnector.{a}", "attribute", "present", "connector.py reads self.<it>")
        for a in ("connector_worker", "connector_scheduler")
    ),
    *(
        Use(
            f"{CONNECTOR_V1}.base:KVConnectorBase_V1.{m}",
            "signature",
            sig,
            "connector.py overrides it",
            override=CONNECTOR_CLASS,
        )
        for m, sig in [
            ("get_mem_pool_context", "(self)"),
            ("get_block_ids_with_load_errors", "(self)"),
            ("get_transfer_results", "(self, finished_req_ids)"),
        ]
    ),
    Use(
        f"{CONNECTOR_V1}.base:KVConnectorTransferResults.failed_recving",
        "attribute",
        "present",
        "connector.get_transfer_results: a failed load of a model with several KV-cache groups",
    ),
    # Hooks every connector inherits: a new one may need an answer from the plug-in.
    Use(f"{CONNECTOR_V1}.base:KVConnectorBase_V1", "methods", CONNECTOR_BASE_METHODS, "OffloadingConnector's base"),
    Use(
        f"{CONNECTOR_V1}.base:KVConnectorBase_V1.supports_sleep_mode",
        "signature",
        ABSENT,
        "vllm_api.OffloadingConnector overrides it (0.33)",
        override="vllm_api.py:OffloadingConnector",
    ),
    Use(f"{CONNECTOR_V1}.base:KVConnectorBase_V1._vllm_config", "attribute", "present", "connector.py"),
    Use(f"{CONNECTOR_V1}.base:KVConnectorRole.SCHEDULER", "attribute", "present", "connector.py"),
    Use(
        f"{CONNECTOR_V1}.base:KVConnectorWorkerMetadata.aggregate",
        "signature",
        "@abstractmethod (self, other)",
        "CachexferdWorkerMetadata overrides it",
        override="connector.py:CachexferdWorkerMetadata",
    ),
    Use(
        f"{OFFLOADING}.common:OffloadingWorkerMetadata",
        "bases",
        "KVConnectorWorkerMetadata",
        "CachexferdWorkerMetadata subclasses it",
    ),
    Use(
        f"{OFFLOADING}.common:OffloadingWorkerMetadata",
        "fields",
        "completed_jobs=field(default_factory=dict), transfer_stats=field(default_factory=TransferStats)",
        "CachexferdWorkerMetadata adds a field after them, built by position",
    ),
    Use(
        f"{OFFLOADING}.common:OffloadingWorkerMetadata",
        "methods",
        "aggregate, mark_completed",
        "CachexferdWorkerMetadata subclasses it",
    ),
    Use(
        f"{OFFLOADING}.common:OffloadingWorkerMetadata.aggregate",
        "signature",
        "(self, other)",
        "CachexferdWorkerMetadata calls it",
    ),
    Use(
        f"{OFFLOADING}.scheduler:OffloadingConnectorScheduler.manager",
        "attribute",
        "present",
        "connector.update_connector_output",
    ),
    Use(f"{OFFLOADING}.worker:OffloadingConnectorWorker.worker", "attribute", "present", "connector.py"),
    Use(f"{OFFLOADING}.worker:OffloadingConnectorWorker.spec", "attribute", "present", "connector.py"),
    Use("vllm.v1.outputs:KVConnectorOutput.kv_connector_worker_meta", "attribute", "present", "connector.py"),
    Use("vllm.v1.kv_cache_interface:KVCacheConfig.kv_cache_tensors", "attribute", "present", "vllm_api.backing_sizes"),
    Use("vllm.v1.kv_cache_interface:KVCacheConfig.kv_cache_groups", "attribute", "present", "connector.py"),
    Use("vllm.v1.kv_cache_interface:KVCacheConfig.kv_tp_replicas", "attribute", "present", "vllm_api.replicated_kv"),
    Use("vllm.v1.kv_cache_interface:KVCacheTensor.size", "attribute", "present", "vllm_api.backing_sizes"),
]

VLLM_CONFIG = [
    *(
        Use(f"vllm.config.vllm:VllmConfig.{a}", "attribute", "present", "connector.py, vllm_api.instance_id")
        for a in (
            "kv_transfer_config",
            "cache_config",
            "device_config",
            "instance_id",
            "model_config",
            "parallel_config",
        )
    ),
    Use("vllm.config.model:ModelConfig.use_mla", "attribute", "present", "vllm_api.replicated_kv"),
    *(
        Use(f"vllm.config.parallel:ParallelConfig.{a}", "attribute", "present", "vllm_api.replicated_kv")
        for a in ("tensor_parallel_size", "world_size", "decode_context_parallel_size", "prefill_context_parallel_size")
    ),
    Use("vllm.config.cache:CacheConfig.enable_prefix_caching", "attribute", "present", "connector.py: loads or not"),
    Use("vllm.config.kv_transfer:KVTransferConfig.kv_connector_extra_config", "attribute", "present", "connector.py"),
    Use("vllm.config.kv_transfer:KVTransferConfig.kv_load_failure_policy", "attribute", "present", "connector.py"),
    Use("vllm.config.cache:CacheConfig.prefix_caching_hash_algo", "attribute", "present", "connector.py"),
    Use("vllm.config.device:DeviceConfig.device_type", "attribute", "present", "connector.get_mem_pool_context"),
]

# engine/kv_memory.py answers vLLM's one torch.zeros call for the CPU KV cache (vllm_api.KV_ALLOCATION).
KV_ALLOCATION = [
    Use(
        "vllm.v1.worker.utils:allocate_kv_cache",
        "calls",
        "torch.zeros(buf_size, dtype=torch.int8, device=device)",
        "engine.kv_memory.SegmentAllocation answers this call",
        callee="zeros",
    ),
    Use(
        "vllm.v1.worker.gpu_worker:Worker.initialize_from_config",
        "calls",
        "get_kv_transfer_group().get_mem_pool_context()",
        "the KV cache is allocated inside the connector's context",
        callee="get_mem_pool_context",
    ),
    Use("vllm.v1.worker.cpu_worker:CPUWorker", "bases", "Worker", "the CPU worker initializes as the GPU one"),
]

# bench.py runs vLLM's offline engine (vllm_api.offline_engine) with these engine arguments.
BENCH = [
    Use("vllm.entrypoints.llm:LLM", "binds", "present", "vllm_api.offline_engine imports it"),
    Use("vllm.sampling_params:SamplingParams", "binds", "present", "vllm_api.offline_engine imports it"),
    Use(
        "vllm.entrypoints.llm:LLM.generate",
        "signature",
        "(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None, priority=None, "
        "tokenization_kwargs=None, mm_processor_kwargs=None)",
        "bench.ttft",
    ),
    *(
        Use(f"vllm.sampling_params:SamplingParams.{a}", "attribute", "present", "bench.ttft")
        for a in ("max_tokens", "temperature")
    ),
    Use("vllm.outputs:RequestOutput.num_cached_tokens", "attribute", "present", "bench.ttft"),
    *(
        Use(f"vllm.engine.arg_utils:EngineArgs.{a}", "attribute", "present", "bench.engine passes it to LLM")
        for a in (
            "model",
            "dtype",
            "block_size",
            "enforce_eager",
            "seed",
            "max_num_seqs",
            "kv_cache_memory_bytes",
            "max_model_len",
            "enable_prefix_caching",
            "kv_transfer_config",
        )
    ),
]

USES: list[Use] = [*IMPORTS, *SPEC, *MANAGER, *WORKER, *CONNECTOR_USES, *VLLM_CONFIG, *KV_ALLOCATION, *BENCH]


def _key(name: str, kind: str) -> str:
    return f"{name} {kind}"


HANDLED: dict[str, dict[str, Handled]] = {
    "0.33": {
        _key(f"{KV_OFFLOAD}:OffloadingManager", "methods"): Handled(
            MANAGER_METHODS.replace("get_load_source", "config_info, get_load_source")
            .replace("has_pending_work, ", "has_pending_work, lock, ")
            .replace("on_schedule_end", "on_reset_flushed, on_schedule_end"),
            "three hooks with defaults the plug-in keeps: lock (a no-op: vLLM's scheduler thread is the only "
            "one that enters CachexferdManager; vllm_api.manager_lock for the plug-in's own calls), "
            "on_reset_flushed (not needed: reset_cache starts a new index whose owner token refuses any late "
            "write of a block the reset freed) and config_info (no info labels published)",
        ),
        _key(f"{KV_OFFLOAD}:OffloadingEvent", "fields"): Handled(
            "keys, medium, removed, locality=None, ownership=None, removal_expected=False, metadata_only=False",
            "events.TierEvents builds it by keyword and leaves metadata_only False: every event it emits is a "
            "block that became loadable or stopped being loadable, never a release of vLLM's event metadata alone",
        ),
        _key(f"{KV_OFFLOAD}:OffloadingManager.lock", "signature"): Handled(
            "@property (self)", "vllm_api.manager_lock(manager) enters it on 0.33, a null context on 0.32"
        ),
        _key(f"{KV_OFFLOAD}:OffloadingSpec", "methods"): Handled(
            SPEC_METHODS.replace("build_metric_definitions", "build_metric_definitions, config_info_keys"),
            "config_info_keys (ConfigInfo label names) keeps vLLM's default: the plug-in publishes none",
        ),
        _key(f"{CONNECTOR_V1}.base:KVConnectorBase_V1", "methods"): Handled(
            CONNECTOR_BASE_METHODS.replace("reset_capture_state, ", "reset_capture_state, restore_kv_caches, ")
            .replace(
                "supports_divergent_local_hybrid_hits, ", "supports_divergent_local_hybrid_hits, supports_sleep_mode, "
            )
            .replace("take_events, ", "take_events, unregister_kv_caches, "),
            "sleep mode's hooks: vllm_api.OffloadingConnector answers supports_sleep_mode with False, so vLLM refuses "
            "enable_sleep_mode with the plug-in and never calls unregister_kv_caches / restore_kv_caches",
        ),
        _key(f"{CONNECTOR_V1}.base:KVConnectorBase_V1.supports_sleep_mode", "signature"): Handled(
            "@classmethod (cls, kv_transfer_config)", "vllm_api.OffloadingConnector overrides it: no sleep mode"
        ),
        _key(f"{KV_OFFLOAD}:OffloadingWorker.submit_load", "signature"): Handled(
            "@abstractmethod (self, job_id, src_spec, dst_spec, expedited=False)",
            "vllm_api.OffloadingWorker drops the expedited flag for a subclass whose submit_load does not take it",
            drops=("expedited",),
        ),
    },
}
