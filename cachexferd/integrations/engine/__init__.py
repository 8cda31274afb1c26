"""The engine-side parts that any engine integration uses.

The daemon connection with its liveness and give-up rules (connection.py, liveness.py),
failure reporting (failures.py), the offload index calls (index_calls.py), the
shared-memory page cache and KV allocation (shm_cache.py, kv_memory.py) and the plug-in
options (options.py).

Nothing here imports an engine, nor an integration of one: an integration for another
engine imports this package as the vLLM integration (``cachexferd.integrations.vllm``) does.
"""
