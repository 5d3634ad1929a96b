"""The private torch names ``shardkit.modelparallel`` uses, imported here and nowhere else (the pytree and
dispatch-mode names it shares with other packages are in ``shardkit.utils._torch_private``).

torch's multi-tensor ("foreach") kernels, the ones ``torch.optim``'s own fast paths use: one launch per batch of
tensors instead of one per tensor, which is what the fused smp optimizers (``modelparallel.optimizers``: LAMB,
NovoGrad) are for. torch exposes them only under underscore names. Each was checked present on torch 2.8.0,
2.11.0, 2.13.0 and 2.14.1 (CPU and CUDA wheels, 2026-11-27). If one moves, ``modelparallel.optimizers`` stops
importing; ``tests/compat/test_torch_private.py`` says which.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

foreach_add_ = torch._foreach_add_
foreach_addcmul_ = torch._foreach_addcmul_
foreach_copy_ = torch._foreach_copy_
foreach_div = torch._foreach_div
foreach_div_ = torch._foreach_div_
foreach_mul = torch._foreach_mul
foreach_mul_ = torch._foreach_mul_
foreach_norm = torch._foreach_norm
foreach_sqrt_ = torch._foreach_sqrt_


def is_compiled_module(module: nn.Module) -> bool:
    """Whether calling ``module`` runs compiled code: ``torch.compile(module)``'s wrapper (an ``OptimizedModule``,
    whose ``forward`` is set on the instance) or a module compiled in place by ``module.compile()`` (which leaves
    ``forward`` alone and sets ``_compiled_call_impl``). The wrapper's class lives in ``torch._dynamo.eval_frame``,
    looked up only once something imported it: no wrapper can exist before then, and importing dynamo is slow.
    """
    if module.__dict__.get("_compiled_call_impl") is not None:
        return True
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


__all__ = [
    "foreach_add_",
    "foreach_addcmul_",
    "foreach_copy_",
    "foreach_div",
    "foreach_div_",
    "foreach_mul",
    "foreach_mul_",
    "foreach_norm",
    "foreach_sqrt_",
    "is_compiled_module",
]
