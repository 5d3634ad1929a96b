"""The split layers, the vocabulary-parallel loss and sequence parallelism equal their unsplit forms at TP 2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardkit import tensor_parallel as tp
from shardkit.testing import run_distributed


def _mine(full: torch.Tensor, dim: int, state: tp.ParallelState) -> torch.Tensor:
    return full.chunk(state.tp_size, dim)[state.tp_rank]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _linear_pair(state: tp.ParallelState) -> dict[str, float]:
    """Column (no gather) then row (parallel input), and column (gather) then row (split here), against nn.Linear."""
    errors = {}
    x = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(7))
    for gather in (False, True):
        torch.manual_seed(1)
        up = tp.ColumnParallelLinear(8, 12, gather_output=gather, keep_master_weight_for_test=True)
        down = tp.RowParallelLinear(12, 8, input_is_parallel=not gather, keep_master_weight_for_test=True)
        with torch.no_grad():
            up.bias.copy_(_mine(torch.arange(12.0) / 10, 0, state))
            down.bias.fill_(0.5)
        ref_up, ref_down = nn.Linear(8, 12), nn.Linear(12, 8)
        with torch.no_grad():
            ref_up.weight.copy_(up.get_master_weight())
            ref_up.bias.copy_(torch.arange(12.0) / 10)
            ref_down.weight.copy_(down.get_master_weight())
            ref_down.bias.fill_(0.5)
        assert up.master_weight is not None and torch.equal(up.get_master_weight(), up.master_weight)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, ref = down(torch.tanh(up(xa))), ref_down(torch.tanh(ref_up(xb)))
        (out**2).sum().backward()
        (ref**2).sum().backward()
        errors[f"out gather={gather}"] = _err(out, ref)
        errors[f"input grad gather={gather}"] = _err(xa.grad, xb.grad)
        errors[f"up grad gather={gather}"] = _err(up.weight.grad, _mine(ref_up.weight.grad, 0, state))
        errors[f"up bias grad gather={gather}"] = _err(up.bias.grad, _mine(ref_up.bias.grad, 0, state))
        errors[f"down grad gather={gather}"] = _err(down.weight.grad, _mine(ref_down.weight.grad, 1, state))
        errors[f"down bias grad gather={gather}"] = _err(down.bias.grad, ref_down.bias.grad)
    full = tp.tp_state_dict(down)["weight"].full_tensor()
    errors["dtensor view"] = _err(full, ref_down.weight)
    return errors


def _embeddings(state: tp.ParallelState) -> dict[str, float]:
    errors = {}
    ids = torch.tensor([[0, 3, 9, 5], [7, 1, 2, 9]])
    for cls in (tp.VocabParallelEmbedding, tp.ParallelEmbedding):
        torch.manual_seed(2)
        emb = cls(10, 6, padding_idx=9)
        weight = emb.get_master_weight().clone().requires_grad_()
        out, ref = emb(ids), F.embedding(ids, weight, padding_idx=9)
        (out * torch.arange(6.0)).sum().backward()
        (ref * torch.arange(6.0)).sum().backward()
        dim = emb.tp_specs["weight"].dim
        errors[f"{cls.__name__} out"] = _err(out, ref)
        errors[f"{cls.__name__} grad"] = _err(emb.weight.grad, _mine(weight.grad, dim, state))
    return errors


def _layers(rank: int, world_size: int) -> dict[str, float]:
    state = tp.init_parallel_state(tensor=2)
    return {**_linear_pair(state), **_embeddings(state)}


def test_split_layers_equal_the_unsplit_layers_in_forward_and_backward() -> None:
    for errors in run_distributed(_layers, 2):
        assert errors and max(errors.values()) < 1e-5, errors


def _loss_and_sequence(rank: int, world_size: int) -> dict[str, float]:
    state = tp.init_parallel_state(tensor=2)
    errors = {}
    logits = torch.randn(2, 5, 10, generator=torch.Generator().manual_seed(3))
    target = torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(4))
    local = _mine(logits, -1, state).clone().requires_grad_()
    before = local.detach().clone()
    full = logits.clone().requires_grad_()
    loss = tp.vocab_parallel_cross_entropy(local, target)
    ref = F.cross_entropy(full.view(-1, 10), target.view(-1), reduction="none").view(2, 5)
    (loss * torch.arange(10.0).view(2, 5)).sum().backward()
    (ref * torch.arange(10.0).view(2, 5)).sum().backward()
    errors["loss"] = _err(loss, ref)
    errors["logit grad"] = _err(local.grad, _mine(full.grad, -1, state))
    errors["logits untouched"] = _err(local.detach(), before)

    # Sequence parallelism: the same MLP with the activations split along the sequence between the layers.
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(5))
    outs, grads = [], []
    for sp in (False, True):
        torch.manual_seed(6)
        up = tp.ColumnParallelLinear(8, 16, gather_output=False, sequence_parallel=sp)
        down = tp.RowParallelLinear(16, 8, input_is_parallel=True, sequence_parallel=sp)
        with torch.no_grad():
            down.bias.fill_(0.25)
        xin = (_mine(x, 1, state) if sp else x).clone().requires_grad_()
        out = down(F.gelu(up(xin)))
        (out**2).sum().backward()
        outs.append(tp.gather_from_tp(out.detach(), dim=1) if sp else out.detach())
        grads.append([tp.gather_from_tp(xin.grad, dim=1) if sp else xin.grad, up.weight.grad, down.bias.grad])
    errors["sequence parallel out"] = _err(outs[1], outs[0])
    errors["sequence parallel input grad"] = _err(grads[1][0], grads[0][0])
    errors["sequence parallel weight grad"] = _err(grads[1][1], grads[0][1])
    errors["sequence parallel bias grad"] = _err(grads[1][2], grads[0][2])
    return errors


def test_vocab_parallel_loss_and_sequence_parallel_equal_the_unsplit_forms() -> None:
    for errors in run_distributed(_loss_and_sequence, 2):
        assert errors and max(errors.values()) < 1e-5, errors
