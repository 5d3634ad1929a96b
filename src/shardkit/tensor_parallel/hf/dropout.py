"""Dropout inside a Hugging Face attention module split across tensor-parallel ranks: a different mask on each rank
for its own heads, the same mask on every rank for the replicated output.

HF attention applies dropout to the attention probabilities inside its ``forward`` (``sdpa``'s ``dropout_p``, or
``F.dropout``), on this rank's heads only. With every rank's default generator in the same state (one seed for the
tensor-parallel group), each rank would drop the same pattern in its heads as every other rank does in its own. A
:class:`SplitDropoutRegion` puts forward hooks on the attention module: on entry it draws one number from the
default generator (every rank draws the same), saves the default state, and seeds the generators with that number
and the tensor-parallel rank; on exit it puts the default state back. Children named ``replicated`` (GPT-2's
``resid_dropout``, applied after the row-parallel projection's all-reduce) run on the saved default state instead,
so their masks agree across ranks, as they must.

Why not the model-parallel tracker's stream: HF's gradient checkpointing recomputes the layer with torch's
checkpoint, which restores the default generators but knows nothing of the tracker, so a tracker stream would give
the recomputed forward other masks than the first (silently wrong gradients). Deriving the region's seed from the
default generator makes the recomputation draw the same seed, hence the same masks, with no replay to set up. The
random state lives on the region object (not a ``ContextVar``) because the recomputation's hooks run on autograd's
threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from shardkit.tensor_parallel.random import (
    GeneratorStates,
    generator_states,
    seed_generators,
    set_generator_states,
)

_SEED_BOUND = 2**40
_RANK_STRIDE = 1_000_003  # keeps the ranks' seeds apart for any drawn value


class SplitDropoutRegion:
    """Forward hooks giving ``module``'s dropout a per-rank stream, except in its ``replicated`` children.

    Example::

        SplitDropoutRegion(model.transformer.h[0].attn, tp_rank=1, replicated=["resid_dropout"])
    """

    def __init__(self, module: nn.Module, tp_rank: int, replicated: Sequence[str] = ()) -> None:
        """Hook ``module`` (and its ``replicated`` children, by attribute name)."""
        self.tp_rank = tp_rank
        self._outside: list[GeneratorStates] = []  # the default states saved at each open region (a stack)
        self._inside: list[GeneratorStates] = []  # the region's states while a replicated child runs
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._exit, always_call=True)
        for name in replicated:
            child = getattr(module, name)
            child.register_forward_pre_hook(self._enter_replicated)
            child.register_forward_hook(self._exit_replicated, always_call=True)

    def _enter(self, module: nn.Module, args: Any) -> None:
        if not module.training:
            return
        drawn = int(torch.randint(_SEED_BOUND, (1,)).item())  # the same draw on every rank: advances alike
        self._outside.append(generator_states())
        seed_generators(drawn * _RANK_STRIDE + self.tp_rank)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if module.training and self._outside:
            set_generator_states(self._outside.pop())

    def _enter_replicated(self, module: nn.Module, args: Any) -> None:
        if module.training and self._outside:
            self._inside.append(generator_states())
            set_generator_states(self._outside[-1])

    def _exit_replicated(self, module: nn.Module, args: Any, output: Any) -> None:
        if module.training and self._inside:
            self._outside[-1] = generator_states()
            set_generator_states(self._inside.pop())
