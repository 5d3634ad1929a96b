"""Cross-entropy over a vocabulary split across the tensor-parallel ranks, without gathering the logits.

Each rank holds ``vocab / t`` columns of the logits (a column-parallel output layer with ``gather_output=False``).
The loss needs only three numbers per token from the whole vocabulary: the maximum (for a stable softmax), the sum
of exponentials and the target's logit. Each rank computes its part of them and two all-reduces of ``tokens`` values
(one ``MAX``, one ``SUM`` of the other two stacked) combine them: ``tokens * 3`` values on the wire instead of
``tokens * vocab``. The gradient is local: ``softmax - one_hot(target)`` restricted to the rank's columns.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from shardkit.distributed.collectives import all_reduce
from shardkit.tensor_parallel.mappings import tp_group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        local_vocab = logits.shape[-1]
        start = dist.get_rank(group) * local_vocab
        logits_max = logits.detach().amax(dim=-1)
        all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group, label="tp.cross_entropy.max")
        shifted = logits.detach() - logits_max.unsqueeze(-1)

        outside = (target < start) | (target >= start + local_vocab)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sums = torch.stack([target_logit, exp.sum(dim=-1)])
        all_reduce(sums, group=group, label="tp.cross_entropy.sum")
        target_logit, sum_exp = sums[0], sums[1]

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        return torch.log(sum_exp) - target_logit

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        return grad.mul_(grad_loss.unsqueeze(-1)), None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor, target: torch.Tensor, group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """The per-token cross-entropy loss (shape of ``target``, no reduction) from logits split on the last dimension.

    ``vocab_parallel_logits[..., j]`` on tensor-parallel rank ``r`` is the logit of token ``r * V/t + j``;
    ``target`` holds global token ids and is the same on every rank. ``group`` is the tensor-parallel group (the
    current state's when None). The logits are not modified.

    Example::

        logits = output_layer(h)          # ColumnParallelLinear(dim, vocab, gather_output=False)
        loss = vocab_parallel_cross_entropy(logits, targets).mean()
    """
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group(group))
