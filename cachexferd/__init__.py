"""cachexferd: a per-GPU KV-cache transfer daemon for LLM inference engines."""

__version__ = "0.1.0"
