"""Where a forward runs: under checkpointing, in its recomputation, or with checkpointing switched off.

Modules with side effects in ``forward`` (counters, caches, logging, statistics) ask :func:`is_recomputing` so
the side effect happens once, not again when backward recomputes the forward. The flags are
``contextvars.ContextVar``\\ s, so they are per thread (and per asyncio task), as fairscale's thread-local flags
were. A flag never has to cross threads: the checkpoint wrapper enters :func:`enable_checkpointing` inside the
checkpointed forward and :func:`enable_recomputing` inside the recomputation itself, on whichever thread autograd
runs it (on CUDA that is one of autograd's device threads, not the thread that called ``backward``).
:func:`disable_checkpointing` is read by the wrapper when its forward starts, on the caller's thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

_checkpointing: ContextVar[bool] = ContextVar("shardkit_is_checkpointing", default=False)
_recomputing: ContextVar[bool] = ContextVar("shardkit_is_recomputing", default=False)
_checkpointing_disabled: ContextVar[bool] = ContextVar("shardkit_checkpointing_disabled", default=False)


@contextlib.contextmanager
def _set(flag: ContextVar[bool]) -> Iterator[None]:
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)


def disable_checkpointing() -> contextlib.AbstractContextManager[None]:
    """A context in which checkpoint-wrapped modules run a plain forward: activations are kept, nothing recomputed.

    Useful for a step that has memory to spare, or to compare against an unwrapped run. It applies to forwards
    started inside the context on this thread; the backward of such a forward needs nothing from it.

    Example::

        with disable_checkpointing():
            loss = model(x).sum()  # every checkpoint_wrapper'd block stores its activations
        loss.backward()  # no forward runs again
    """
    return _set(_checkpointing_disabled)


def enable_checkpointing() -> contextlib.AbstractContextManager[None]:
    """A context in which :func:`is_checkpointing` is True (the wrapper enters it around a checkpointed forward)."""
    return _set(_checkpointing)


def enable_recomputing() -> contextlib.AbstractContextManager[None]:
    """A context in which :func:`is_recomputing` is True (the wrapper enters it around the recomputation)."""
    return _set(_recomputing)


def is_checkpointing() -> bool:
    """Whether the forward running now is a checkpointed one (its activations will be recomputed in backward)."""
    return _checkpointing.get()


def is_recomputing() -> bool:
    """Whether the forward running now is the recomputation of a checkpointed forward, during backward.

    Use it to keep forward side effects from happening twice::

        class Counter(nn.Module):
            def forward(self, x):
                if not is_recomputing():
                    self.calls += 1
                return x
    """
    return _recomputing.get()


def is_checkpointing_disabled() -> bool:
    """Whether :func:`disable_checkpointing` is in force for forwards started now on this thread."""
    return _checkpointing_disabled.get()
