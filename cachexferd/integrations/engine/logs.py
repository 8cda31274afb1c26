"""The log of the engine-side parts: one logger, which the integration points into its
engine's log.

Until an integration calls ``log_to``, lines go to the ``cachexferd.engine`` logger. An
integration names a logger under its engine's own, so that the lines show in the engine's
log, with its format and level, beside the engine's own lines.
"""

from __future__ import annotations

import logging

# Every module of this package writes through this adapter, so that the logger behind it
# can be chosen after they are imported (the caller's file and line still show: logging
# skips its own frames).
log = logging.LoggerAdapter(logging.getLogger("cachexferd.engine"))


def log_to(logger: logging.Logger) -> None:
    """Writes the engine-side parts' lines to ``logger`` from now on."""
    log.logger = logger
