"""The private torch names ``shardkit plan`` uses, imported here and nowhere else (the pytree and dispatch-mode
names it shares with other packages are in ``shardkit.utils._torch_private``).

Each was checked present on torch 2.8.0, 2.11.0, 2.13.0 and 2.14.1 (CPU and CUDA wheels, 2026-11-27);
``tests/compat/test_torch_private.py`` resolves them on the running torch. Besides these,
``plan.peerless.PeerlessGroup`` overrides the private virtual methods torch's collectives call on a Python
``ProcessGroup`` (``_allgather_base``, ``_reduce_scatter_base``, ``_set_group_name``, ``_set_group_desc``); they
are defined there, not imported, and ``utils.torch_compat.PRIVATE_APIS`` checks torch still has them.
"""

from __future__ import annotations

from typing import Any

import torch

# Completes a collective's work handle from a future: the planner's stand-in process group returns finished
# handles through it. If it moves, ``plan.peerless`` stops importing and no distributed strategy can be planned.
from torch._C._distributed_c10d import _create_work_from_future as create_work_from_future  # type: ignore[attr-defined]

# Steps out of the active dispatch modes: the attention planner builds small stand-in tensors the planned run's
# memory must not count. If it moves, ``plan.attention`` stops importing.
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes


def fused_sdp_choice(*args: Any, **kwargs: Any) -> int:
    """``torch._fused_sdp_choice``: the index of the ``SDPBackend`` the CPU would pick for an attention call.

    If it moves, planning a model with ``scaled_dot_product_attention`` on the CPU target fails."""
    return int(torch._fused_sdp_choice(*args, **kwargs))


def flash_attention_for_cpu(*args: Any, **kwargs: Any) -> Any:
    """``aten._scaled_dot_product_flash_attention_for_cpu``, the CPU flash-attention kernel the planner runs.

    If it moves, planning attention that the CPU runs as flash attention fails."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*args, **kwargs)


def efficient_attention(*args: Any, **kwargs: Any) -> Any:
    """``aten._scaled_dot_product_efficient_attention``, the memory-efficient kernel the planner runs.

    If it moves, planning attention that would run as memory-efficient attention fails."""
    return torch.ops.aten._scaled_dot_product_efficient_attention(*args, **kwargs)


def mem_tracker() -> Any:
    """A new ``torch.distributed._tools.mem_tracker.MemTracker``, imported at the call (as before: the planner's
    cross-check is the only user, and an import failure must not stop ``shardkit.plan`` from importing).

    If it moves, ``shardkit plan --measure``'s torch cross-check fails; the plan itself is unaffected."""
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker()


__all__ = [
    "create_work_from_future",
    "disable_current_modes",
    "efficient_attention",
    "flash_attention_for_cpu",
    "fused_sdp_choice",
    "mem_tracker",
]
