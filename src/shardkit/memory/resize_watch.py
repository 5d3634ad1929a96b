"""Seeing storage resizes: FSDP frees and refills its full parameters with ``UntypedStorage.resize_``, which no
dispatch mode sees, so memory counters (:class:`~shardkit.memory.MemoryTracker`, ``shardkit.plan``'s accountant)
watch that method for as long as they are active.

Example::

    undo = watch_resizes(lambda storage: print(storage.nbytes()))
    try:
        torch.empty(4).untyped_storage().resize_(0)  # prints 0
    finally:
        undo()
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch


def watch_resizes(
    after: Callable[[torch.UntypedStorage], None],
    mark: Optional[str] = None,
    busy: str = "a storage-resize watch is already active in this process; use one at a time",
) -> Callable[[], None]:
    """Call ``after(storage)`` after every ``torch.UntypedStorage.resize_`` until the returned undo is called.

    ``mark`` makes the watch exclusive: while one with that mark is active, another raises ``RuntimeError(busy)``
    (for counters that must not nest). The undo puts back the method that was there before.
    """
    current: Any = torch.UntypedStorage.resize_
    if mark is not None and getattr(current, mark, False):
        raise RuntimeError(busy)

    def resize(storage: torch.UntypedStorage, size: int) -> Any:
        result = current(storage, size)
        after(storage)
        return result

    patched = functools.wraps(current)(resize)
    if mark is not None:
        setattr(patched, mark, True)
    torch.UntypedStorage.resize_ = patched  # type: ignore[method-assign, assignment]

    def undo() -> None:
        torch.UntypedStorage.resize_ = current  # type: ignore[method-assign]

    return undo


__all__ = ["watch_resizes"]
