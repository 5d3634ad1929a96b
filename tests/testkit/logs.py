"""What the ``shardkit`` logger warned about while a test ran (its warnings are part of what shardkit promises)."""

from __future__ import annotations

import logging


class WarningRecorder(logging.Handler):
    """A handler keeping each warning's message; :meth:`attach` adds it to the ``shardkit`` logger."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def attach(self) -> WarningRecorder:
        logging.getLogger("shardkit").addHandler(self)
        return self

    def detach(self) -> None:
        logging.getLogger("shardkit").removeHandler(self)
