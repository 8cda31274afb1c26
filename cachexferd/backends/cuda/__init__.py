"""The cuda backend (docs/cuda.md): ``backend`` is what the daemon loads by name.

- driver.py: the driver seam (every GPU operation of the copy path); cudart.py the real
  driver (ctypes on CUDA's libraries), fake.py a CPU stand-in for tests and benchmarks;
- copy_plan.py, pieces.py: planning (method rule, DMA plans, kernel launches), pure Python;
- methods.py: the copy methods behind one interface; kernel.py: the Triton copy kernel;
  memcpy.py: the 2D-memcpy bindings of the DMA method;
- lanes.py: issue and settlement on the event loop's thread; device_cache.py: an attached
  cache (two lanes); threads.py: every thread the backend starts;
- pool.py: the pinned host pool; ipc.py: the CUDA IPC import.

Nothing is imported here: the cpu path imports none of it.
"""
