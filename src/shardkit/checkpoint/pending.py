"""A checkpoint that has been read and validated but not yet applied (shared by the adapters and the engine).

Loading is split so that nothing is written into the model or optimizer until every rank has read and checked
everything: reading (this rank alone, no collectives), then :attr:`PendingLoad.fetch` (collectives every rank
issues, such as filling DCP targets), then :attr:`PendingLoad.apply` (the only step that changes anything).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


def _nothing() -> None:
    return None


@dataclass
class PendingLoad:
    """A read and validated checkpoint, not yet applied: ``fetch()`` (collective) then ``apply()``."""

    apply: Callable[[], None]
    fetch: Callable[[], None] = field(default=_nothing)
