"""Standard `logging` for neuronctl: quiet by default, `-v` / `--log-level` to see the steps.

Modules log to `logging.getLogger(__name__)` (all under "neuronctl"); only the CLI calls
`setup`, once, so library users keep their own configuration. INFO says what the tool does
(key computed, cache hit or miss and why, pull / compile / publish steps); DEBUG adds detail.
"""

from __future__ import annotations

import logging
import sys

LEVELS = ("debug", "info", "warning", "error")
DEFAULT = "warning"
LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def level_for(level: str | None, verbose: int = 0) -> int:
    """An explicit level wins; else each -v lowers the default one step (info, then debug)."""
    if level:
        name = level.lower()
        if name not in LEVELS:
            raise ValueError(f"unknown log level {level!r}: use " + " | ".join(LEVELS))
        return int(getattr(logging, name.upper()))
    return {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)


def setup(level: int) -> None:
    logger = logging.getLogger("neuronctl")
    logger.setLevel(level)
    for handler in list(logger.handlers):  # setup twice (tests, embedding) must not duplicate
        if getattr(handler, "_neuronctl", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%H:%M:%S"))
    handler._neuronctl = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
