"""cachexferd: a per-GPU KV-cache transfer daemon for LLM inference engines."""

import warnings

__version__ = "0.1.0"

# torch's CPU wheel warns at import when numpy is absent; cachexferd never converts to numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
