"""The parts of ShardedDataParallel's API that fairscale code relies on: attribute forwarding, DDP's attributes,
train/eval switching, reduce() after no_sync, the refusal of gradients that require grad, and the warning on a
trainability change. Parity is checked against torch DDP."""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.distributed import DummyProcessGroup, count_comm_bytes
from shardkit.nn import ShardedDataParallel
from shardkit.nn.data_parallel.sharded_ddp import ShardedDataParallel as FromFairscalePath
from shardkit.optim import OSS
from shardkit.testing import run_distributed
from shardkit.testing.models import loss_for
from testkit import average_grads, max_param_diff, rank_batch, tiny_model

SOLO = DummyProcessGroup(rank=0, size=1)


def _solo(model: nn.Module, **kwargs: Any) -> ShardedDataParallel:
    return ShardedDataParallel(model, OSS(model.parameters(), lr=0.1, group=SOLO), **kwargs)


def test_fairscale_module_path() -> None:
    assert FromFairscalePath is ShardedDataParallel


def test_attributes_of_the_wrapped_module_and_of_ddp() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3))
    model.banana = "sweet"  # type: ignore[assignment]
    sdp = _solo(model)
    assert sdp.banana == "sweet"
    assert not hasattr(sdp, "orange")
    with pytest.raises(AttributeError, match="orange"):
        _ = sdp.orange
    assert sdp.module is model
    assert sdp.device_type == "cpu" and sdp.is_multi_device_module is False
    # The wrapper's own attributes win over the module's.
    model.process_group = "not this one"  # type: ignore[assignment]
    assert sdp.process_group is SOLO
    # Deep copies and pickling go through __getattr__ before __init__ state exists: no recursion.
    assert copy.deepcopy(sdp).banana == "sweet"


def test_gradient_that_requires_grad_is_refused_at_forward() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3))
    model[1].bias.grad = torch.zeros(3, requires_grad=True)
    sdp = _solo(model)
    with pytest.raises(RuntimeError, match=r"gradient of parameter '1\.bias' requires grad.*zero_grad"):
        sdp(torch.rand(4, 2))
    model.zero_grad(set_to_none=True)
    sdp(torch.rand(4, 2)).sum().backward()  # cleared: training goes on
    assert model[1].bias.grad is not None and not model[1].bias.grad.requires_grad


def test_trainability_change_warns_unless_told_not_to() -> None:
    for warn in (True, False):
        model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3))
        sdp = _solo(model, warn_on_trainable_params_changed=warn)
        sdp(torch.rand(4, 2))
        model[0].weight.requires_grad_(False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sdp(torch.rand(4, 2))
            sdp(torch.rand(4, 2))  # no second warning for the same change
        relevant = [w for w in caught if "requires_grad changed" in str(w.message)]
        assert len(relevant) == (1 if warn else 0)
        assert model[0].weight not in sdp.sharded_optimizers[0].param_to_rank  # re-partitioned either way


def test_reduce_on_one_rank_needs_accumulated_gradients() -> None:
    model = nn.Linear(2, 2)
    sdp = _solo(model)
    with pytest.raises(RuntimeError, match="no gradient is waiting to be reduced"):
        sdp.reduce()


def _reduce_and_eval(rank: int, world_size: int) -> dict[str, Any]:
    """reduce() after no_sync matches DDP's accumulation; eval forwards do not reduce; train again matches DDP."""
    out: dict[str, Any] = {}
    base = tiny_model("lm")
    ref_inner, sdp_inner = copy.deepcopy(base), copy.deepcopy(base)
    ref = DDP(ref_inner)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    oss = OSS(sdp_inner.parameters(), optim=torch.optim.SGD, lr=0.05, momentum=0.9)
    sdp = ShardedDataParallel(sdp_inner, oss)

    # Accumulate two micro-batches without communication, then reduce by hand (DDP: the last one syncs).
    for micro in range(2):
        for model in (ref, sdp):
            quiet = model is sdp or micro == 0
            with model.no_sync() if quiet else contextlib.nullcontext():  # type: ignore[operator]
                x, y = rank_batch("lm", model, rank, 0, micro)
                loss_for("lm", model(x), y).backward()
    with count_comm_bytes() as meter:
        sdp.reduce()
    out["reduce_calls"] = meter.calls.get("reduce", 0) + meter.calls.get("send", 0)
    owned = {p for p, owner in oss.param_to_rank.items() if owner == rank}
    pairs = list(zip(ref_inner.parameters(), sdp_inner.parameters()))
    out["owned_grad_diff"] = max((p.grad - q.grad).abs().max().item() for p, q in pairs if q in owned)
    out["others_none"] = all(q.grad is None for _, q in pairs if q not in owned)
    try:
        sdp.reduce()
        out["second_reduce"] = "no error"
    except RuntimeError as err:
        out["second_reduce"] = str(err)
    ref_opt.step()
    oss.step()
    out["param_diff_after_reduce"] = max_param_diff(ref_inner, sdp_inner)

    # Eval: a forward without backward communicates nothing but buffers; back in train mode SDP matches DDP.
    ref_opt.zero_grad()
    sdp.zero_grad(set_to_none=True)
    sdp.eval()
    with count_comm_bytes() as meter, torch.no_grad():
        sdp(rank_batch("lm", sdp, rank, 1)[0])
    out["eval_reduces"] = meter.calls.get("reduce", 0) + meter.calls.get("send", 0)
    sdp.train()
    for model in (ref, sdp):
        x, y = rank_batch("lm", model, rank, 2)
        loss_for("lm", model(x), y).backward()
    out["train_again_grad_diff"] = max((p.grad - q.grad).abs().max().item() for p, q in pairs if q in owned)
    ref_opt.step()
    oss.step()
    out["param_diff_end"] = max_param_diff(ref_inner, sdp_inner)
    return out


def test_reduce_by_hand_and_train_eval_switch_match_ddp() -> None:
    for result in run_distributed(_reduce_and_eval, 2):
        assert result["reduce_calls"] > 0
        assert result["owned_grad_diff"] < 1e-6 and result["others_none"]
        assert "no gradient is waiting to be reduced" in result["second_reduce"]
        assert result["param_diff_after_reduce"] < 1e-6
        assert result["eval_reduces"] == 0
        assert result["train_again_grad_diff"] < 1e-6
        assert result["param_diff_end"] < 1e-6


def _cast_after_wrapping(rank: int, world_size: int) -> dict[str, Any]:
    """Casting the wrapper (fairscale's ``to``) or the wrapped model re-plans at the next forward: gradients travel
    in the new dtype."""
    base = tiny_model("lm")
    ref, inner = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    oss = OSS(inner.parameters(), optim=torch.optim.SGD, lr=0.05)
    sdp = ShardedDataParallel(inner, oss)
    out: dict[str, Any] = {}
    for step, how in enumerate(("wrapper", "inner")):
        if how == "wrapper":
            sdp.to(torch.device("cpu"), torch.float64, False)  # fairscale's positional form
            ref.double()
        else:
            inner.float()  # behind the wrapper's back: noticed at the next forward
            ref.float()
        for model in (ref, sdp):
            x, y = rank_batch("lm", model, rank, step)
            loss_for("lm", model(x), y).backward()
        average_grads(ref)
        owned = [(p, q) for p, q in zip(ref.parameters(), inner.parameters()) if q.grad is not None]
        out[f"{how}_grad_diff"] = max((p.grad - q.grad).abs().max().item() for p, q in owned)
        out[f"{how}_dtypes"] = sorted(
            {str(q.grad.dtype) for _, q in owned} | {str(q.dtype) for q in inner.parameters()}
        )
        ref_opt.step()
        oss.step()
        ref_opt.zero_grad()
        oss.zero_grad()
        out[f"{how}_param_diff"] = max_param_diff(ref, inner)
    return out


def test_casting_after_wrapping_replans_the_reduction() -> None:
    for result in run_distributed(_cast_after_wrapping, 2):
        assert result["wrapper_dtypes"] == ["torch.float64"], result
        assert result["wrapper_grad_diff"] < 1e-12 and result["wrapper_param_diff"] < 1e-12, result
        assert result["inner_dtypes"] == ["torch.float32"]
        assert result["inner_grad_diff"] < 1e-6 and result["inner_param_diff"] < 1e-6, result
