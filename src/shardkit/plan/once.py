"""Say each warning once while a plan builds the same model many times.

``shardkit plan`` builds the model once per setting and world size; a warning the model's constructor gives
(transformers logs them, libraries ``warnings.warn`` them) would print that many times. :func:`each_warning_once`
lets the first of each through and drops the repeats, for Python warnings (by text and category, whatever the
filters say: a ``"once"`` filter forgets what it showed whenever any filter changes, as importing sympy does) and
for log records on every handler of every logger (transformers' own handler sits on a logger that propagates to
the root only when the ``CI`` variable is set, so the root's handlers alone are not enough).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any


class _FirstOnly(logging.Filter):
    """Passes a log record whose (logger, level, message) it has not passed before."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def _show_once(show: Callable[..., None]) -> Callable[..., None]:
    """``show`` (a ``warnings.showwarning``) for the first warning of each text and category only."""
    seen: set[tuple[str, type]] = set()

    def show_once(message: Any, category: type, *args: Any, **kwargs: Any) -> None:
        key = (str(message), category)
        if key not in seen:
            seen.add(key)
            show(message, category, *args, **kwargs)

    return show_once


def _handlers() -> list[logging.Handler]:
    loggers = [logging.getLogger()]
    loggers += [logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)]
    return list({id(h): h for logger in loggers for h in logger.handlers}.values())


@contextlib.contextmanager
def each_warning_once() -> Iterator[None]:
    """Within the block, each distinct warning and log message is shown once (see the module docstring)."""
    with contextlib.suppress(ImportError):  # transformers adds its handler on first use: make it exist now
        from transformers.utils import logging as hf_logging

        hf_logging.get_logger("transformers")
    # One filter per handler: a record goes to several handlers, and each must show it once.
    filters = {handler: _FirstOnly() for handler in _handlers()}
    for handler, first in filters.items():
        handler.addFilter(first)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_once(warnings.showwarning)
            yield
    finally:
        for handler, first in filters.items():
            handler.removeFilter(first)


__all__ = ["each_warning_once"]
