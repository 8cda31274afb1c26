"""Client libraries: the engine client (sync and asyncio) and the model-runner helper.

The engine clients import neither torch nor the daemon. ``ShmKVCache`` imports torch only
when a cache is created.
"""

from .aio import AsyncEngineClient
from .engine import EngineClient
from .link import ClientError
from .pending import Completion
from .runner import RunnerClient, ShmKVCache

__all__ = ["AsyncEngineClient", "ClientError", "Completion", "EngineClient", "RunnerClient", "ShmKVCache"]
