"""apply_activation_checkpointing on a transformer: same gradients, fewer saved activation bytes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardkit.nn.checkpoint import CheckpointWrapper, apply_activation_checkpointing
from shardkit.testing.models import Block, LMConfig, TransformerLM, lm_batch

CFG = LMConfig(n_layers=3, dropout=0.1, seq_len=16, d_model=32)


def saved_activation_bytes(model: nn.Module, tokens: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes autograd keeps for backward during one forward (parameters excluded), and the output."""
    param_ptrs = {p.data_ptr() for p in model.parameters()}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if t.data_ptr() not in param_ptrs:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens)
    return total, out


def test_transformer_blocks_checkpointed_in_place() -> None:
    ref = TransformerLM(CFG)
    model = copy.deepcopy(ref)
    names = apply_activation_checkpointing(model, Block)
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    assert all(isinstance(b, CheckpointWrapper) for b in model.blocks)
    assert list(model.state_dict()) == list(ref.state_dict())
    # Already wrapped blocks are left alone.
    assert apply_activation_checkpointing(model, Block) == []

    tokens, targets = lm_batch(CFG, batch_size=4, seed=0)
    torch.manual_seed(11)
    ref_bytes, ref_out = saved_activation_bytes(ref, tokens)
    torch.manual_seed(11)
    ckpt_bytes, out = saved_activation_bytes(model, tokens)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    # Each block now keeps only its input (batch x seq x d_model floats) instead of all its internals.
    block_input_bytes = 4 * CFG.seq_len * CFG.d_model * 4
    blocks_ref = ref_bytes - (ckpt_bytes - CFG.n_layers * block_input_bytes)
    assert ckpt_bytes < ref_bytes / 2, (ckpt_bytes, ref_bytes)
    assert blocks_ref > 5 * CFG.n_layers * block_input_bytes

    TransformerLM.loss_fn(ref_out, targets).backward()
    TransformerLM.loss_fn(out, targets).backward()
    # Seen from the parent, parameter names carry the wrapper's child name (as with torch's wrapper); the
    # order is unchanged.
    assert [n.replace("_checkpoint_wrapped_module.", "") for n, _ in model.named_parameters()] == [
        n for n, _ in ref.named_parameters()
    ]
    for (name, ref_p), p in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, ref_p.grad, msg=name)


def test_predicate_and_outermost_match() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 2))
    names = apply_activation_checkpointing(model, lambda m: isinstance(m, (nn.Sequential, nn.Linear)))
    assert names == ["0", "1"]  # the inner Linears of the matched Sequential are not wrapped again
    assert isinstance(model[0].wrapped_module[0], nn.Linear)
    skipped = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2)))
    names = apply_activation_checkpointing(skipped, nn.Linear, descend=lambda m: m is not skipped[0])
    assert names == ["1.0"]


@pytest.mark.parametrize("target", [[], [int], "Block", 3])
def test_bad_targets_are_rejected(target: object) -> None:
    model = TransformerLM(CFG)
    with pytest.raises(TypeError, match=r"nn\.Module subclasses|callable"):
        apply_activation_checkpointing(model, target)  # type: ignore[arg-type]
    assert not any(isinstance(m, CheckpointWrapper) for m in model.modules())
