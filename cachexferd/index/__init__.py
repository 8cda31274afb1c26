"""Engine-side tiered prefix index over chained block hashes.

Imports neither torch nor the daemon (nor the engine client: the index drives any object
with EngineClient's public methods). ``OffloadIndex`` serves an engine that owns its GPU
tier; ``PrefixIndex`` owns all three tiers and drives the daemons itself.
"""

from .lease import Lease, Match
from .offload import OffloadIndex
from .prefix import IndexStats, PrefixIndex, StoragePolicy
from .transfers import TransferClient
from .types import DoubleFreeError, HashLike, Invalidation, LoadPlan, NoRoomError, OffloadEvent, StorePlan, Tier

__all__ = [
    "DoubleFreeError",
    "HashLike",
    "IndexStats",
    "Invalidation",
    "Lease",
    "LoadPlan",
    "Match",
    "NoRoomError",
    "OffloadEvent",
    "OffloadIndex",
    "PrefixIndex",
    "StoragePolicy",
    "StorePlan",
    "Tier",
    "TransferClient",
]
