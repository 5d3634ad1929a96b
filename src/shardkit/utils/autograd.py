"""Questions about autograd's engine that torch answers only through its private bindings, asked in one place."""

from __future__ import annotations

from shardkit.utils._torch_private import current_graph_task_id


def backward_running() -> bool:
    """True while autograd's engine is running a backward pass on this thread (hooks, recomputation).

    torch has no public call for this; its own FSDP2 and module tracker read the current graph task id the same
    way, so every shardkit caller goes through this one function.
    """
    return current_graph_task_id() != -1


__all__ = ["backward_running"]
