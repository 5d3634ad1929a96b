"""Questions about autograd's engine that torch answers only through its private bindings, asked in one place."""

from __future__ import annotations

import weakref
from typing import Any, Callable

from shardkit.utils._torch_private import current_graph_task_id


def backward_running() -> bool:
    """True while autograd's engine is running a backward pass on this thread (hooks, recomputation).

    torch has no public call for this; its own FSDP2 and module tracker read the current graph task id the same
    way, so every shardkit caller goes through this one function.
    """
    return current_graph_task_id() != -1


def weak_method_hook(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, a bound method, as a tensor hook that does not keep its object alive.

    A tensor that C++ also holds (the base of the views a module's parameters are; a parameter whose gradient
    accumulator lives) keeps its Python object, and so its hooks, alive from C++ (torch 2.13), an edge the cycle
    collector cannot see. A hook that is a bound method of the wrapper owning the tensor then closes a cycle that is
    never freed: the model, its optimizer state and its process groups outlive ``del`` and ``gc.collect()`` (a
    shardkit FSDP model did). This hook calls ``method`` while its object lives and does nothing after.

    Example::

        param.register_post_accumulate_grad_hook(weak_method_hook(self._on_grad_ready))
    """
    ref = weakref.WeakMethod(method)

    def hook(*args: Any, **kwargs: Any) -> Any:
        target = ref()
        return None if target is None else target(*args, **kwargs)

    return hook


__all__ = ["backward_running", "weak_method_hook"]
