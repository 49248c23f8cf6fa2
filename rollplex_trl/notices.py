"""Rollplex's informational messages: what an `auto` switch decided, where a file was written, what a weight sync
aliases. They are logged at INFO, not WARNING (nothing is wrong), and still shown by default, as `[rollplex] …`
lines on stderr.

Python's logging drops INFO records unless someone configures a level, and a library should not configure the root
logger; so, like transformers' own logger, the notices go through one dedicated logger, ``rollplex_trl.notice``,
with its own handler and ``propagate=False`` (a script's ``logging.basicConfig`` does not print them twice).
``ROLLPLEX_VERBOSITY=warning`` (or ``error``) hides them; ``logging.getLogger("rollplex_trl.notice")`` is the
logger to configure or to attach a handler to.
"""

from __future__ import annotations

import logging
import os
import sys

NOTICE_LOGGER = "rollplex_trl.notice"
VERBOSITY_ENV = "ROLLPLEX_VERBOSITY"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_configured = False  # the notices' logger got its handler and level


class _CurrentStderr(logging.StreamHandler):
    """A handler that writes to whatever ``sys.stderr`` is at the time of the record (pytest and notebooks swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # logging.StreamHandler.__init__ assigns it; the property always reads stderr
        pass


def notice_logger() -> logging.Logger:
    """The notices' logger, configured on first use (level from ``ROLLPLEX_VERBOSITY``, default info)."""
    global _configured
    logger = logging.getLogger(NOTICE_LOGGER)
    if not _configured:
        verbosity = os.environ.get(VERBOSITY_ENV, "info").strip().lower()
        if verbosity not in _LEVELS:
            raise ValueError(f"{VERBOSITY_ENV}={verbosity!r}: use one of {', '.join(_LEVELS)}")
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("[rollplex] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(_LEVELS[verbosity])
        logger.propagate = False
        _configured = True
    return logger


def notice(message: str) -> None:
    """Log an informational message at INFO (shown as a ``[rollplex] …`` line unless ``ROLLPLEX_VERBOSITY`` hides
    it). Callers on several processes call it on the main process only."""
    notice_logger().info(message)
