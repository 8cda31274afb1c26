"""cachexferd as vLLM's KV-offloading backend (vLLM v1, OffloadingConnector interface).

Use it from vLLM with::

    kv_transfer_config={"kv_connector": "CachexferdConnector",
                        "kv_connector_module_path": "cachexferd.integrations.vllm",
                        "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}

next to one ``cachexferd serve`` daemon per rank. docs/vllm.md has every option.

The vLLM-facing classes are imported on first use, so the parts that do not need vLLM
(keys, processes) import without it. What does not name vLLM (the daemon connection,
options, failure reports, the index calls, the shared-memory KV cache) is in
``cachexferd.integrations.engine``; its lines are written to vLLM's log, as ``vllm.cachexferd``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..engine.logs import log_to

if TYPE_CHECKING:
    from .connector import CachexferdConnector
    from .spec import CachexferdOffloadingSpec

__all__ = ["CachexferdConnector", "CachexferdOffloadingSpec"]

log_to(logging.getLogger("vllm.cachexferd"))  # a child of vLLM's logger: our lines show in its log


def __getattr__(name: str) -> Any:
    if name == "CachexferdConnector":
        from .connector import CachexferdConnector

        return CachexferdConnector
    if name == "CachexferdOffloadingSpec":
        from .spec import CachexferdOffloadingSpec

        return CachexferdOffloadingSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
