"""fairscale's ``nn.model_parallel.cross_entropy``: the loss over vocabulary-split logits, never gathered."""

import torch

from shardkit import tensor_parallel as tp


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token loss (``target``'s shape) from logits split on the last dimension over the model-parallel group.

    Unlike fairscale's, the logits are left unchanged (fairscale subtracts the maximum from them in place).
    """
    return tp.vocab_parallel_cross_entropy(vocab_parallel_logits, target)


__all__ = ["vocab_parallel_cross_entropy"]
