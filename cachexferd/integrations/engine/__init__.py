"""The engine-side parts that any engine integration uses.

The daemon connection with its liveness and give-up rules (connection.py, liveness.py),
failure reporting (failures.py), the offload index calls (index_calls.py), the
shared-memory page cache and KV allocation (shm_cache.py, kv_memory.py) and the plug-in
options (options.py).

An integration wires them into its engine: it points their log into its engine's log
(``logs.log_to``) and names the titles its engine gives the processes it starts
(``liveness.engine_lineage``). Nothing here imports an engine, nor an integration of one.
"""
