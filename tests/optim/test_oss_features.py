"""OSS features across real ranks: global-norm clipping, add_param_group, fp16 broadcast, group bookkeeping."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from oss_testlib import ddp_pair

from shardkit.distributed import count_comm_bytes
from shardkit.optim import OSS
from shardkit.testing import run_distributed
from shardkit.testing.models import loss_for
from testkit import average_grads, max_param_diff, rank_batch, same_optimizer_state, tiny_model, train_harness_model


def _clip(rank: int, world_size: int) -> list[str]:
    """OSS.clip_grad_norm returns torch's full-model norm and leaves owned gradients as torch clips them."""
    failures = []
    for norm_type in (2.0, float("inf")):
        ref_model, oss_model, _, oss_opt = ddp_pair("lm", "sgd")
        for model in (ref_model, oss_model):
            x, y = rank_batch("lm", model, rank, step=0)
            loss_for("lm", model(x), y).mul(50).backward()
        expected = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.1, norm_type)
        got = oss_opt.clip_grad_norm(0.1, norm_type)
        if not torch.allclose(got, expected, rtol=1e-5) or expected < 0.2:
            failures.append(f"norm {norm_type}: got {got.item()}, torch {expected.item()}")
        owned = [p for p, r in oss_opt.param_to_rank.items() if r == rank]
        ref_grads = dict(zip(oss_model.parameters(), ref_model.parameters()))
        for p in owned:
            if not torch.allclose(p.grad, ref_grads[p].grad, rtol=1e-5, atol=1e-8):
                failures.append(f"norm {norm_type}: owned gradient clipped differently")
    return failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_clip_grad_norm_is_global(world_size: int) -> None:
    for failures in run_distributed(_clip, world_size):
        assert failures == []


def _add_group_and_fp16(rank: int, world_size: int) -> dict[str, float]:
    out: dict[str, float] = {}
    # add_param_group re-partitions: existing AdamW state moves to the new owners and training matches plain.
    model, ref = tiny_model("nested"), tiny_model("nested")
    ref_opt: torch.optim.Optimizer
    params, ref_params = list(model.parameters()), list(ref.parameters())
    opt = OSS(params[:4], optim=torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref_params[:4], lr=1e-2)
    for m, o in ((model, opt), (ref, ref_opt)):
        train_harness_model("nested", m, o, rank, [0], after_backward=lambda m=m: average_grads(m))
    before = {p: r for p, r in opt.param_to_rank.items()}
    opt.add_param_group({"params": params[4:], "lr": 5e-3})  # its 256-element weight displaces a rank-0 tensor
    ref_opt.add_param_group({"params": ref_params[4:], "lr": 5e-3})
    out["owners_moved"] = float(any(opt.param_to_rank[p] != r for p, r in before.items()))
    for m, o in ((model, opt), (ref, ref_opt)):
        train_harness_model("nested", m, o, rank, [1, 2], after_backward=lambda m=m: average_grads(m))
    out["add_group_diff"] = max_param_diff(model, ref)

    # broadcast_fp16 halves the parameter bytes; replicas stay within fp16 rounding of full precision.
    sent = {}
    for fp16 in (False, True):
        ref_model, oss_model, ref_lm_opt, _ = ddp_pair("lm", "adamw")
        oss_opt = OSS(oss_model.parameters(), optim=torch.optim.AdamW, broadcast_fp16=fp16, lr=1e-2, weight_decay=0.1)
        train_harness_model("lm", ref_model, ref_lm_opt, rank, range(2))
        with count_comm_bytes() as meter:
            train_harness_model("lm", oss_model, oss_opt, rank, range(2))
        sent[fp16] = meter.payload_bytes["send"]  # on gloo owners send their buckets to each peer
        out[f"fp16={fp16}_diff"] = max_param_diff(ref_model, oss_model)
    out["byte_ratio"] = sent[True] / sent[False]

    # state_dict(all_ranks=True) consolidates onto every rank: each holds the plain optimizer's state dict.
    out["all_ranks_state"] = float(same_optimizer_state(opt.state_dict(all_ranks=True), ref_opt.state_dict()))
    return out


@pytest.mark.parametrize("world_size", [2])
def test_add_param_group_and_fp16_broadcast(world_size: int) -> None:
    for result in run_distributed(_add_group_and_fp16, world_size):
        assert result["owners_moved"] == 1.0
        assert result["add_group_diff"] <= 1e-6
        assert result["fp16=False_diff"] <= 1e-6
        assert 1e-6 < result["fp16=True_diff"] <= 2e-3  # rounded on receivers, not drifting apart
        assert result["byte_ratio"] == pytest.approx(0.5)
        assert result["all_ranks_state"] == 1.0


def _subgroups(rank: int, world_size: int) -> dict[str, float]:
    """Two independent OSS instances on process groups {0, 1} and {2, 3}: group ranks map to global ranks."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    model, ref = tiny_model("nested"), tiny_model("nested")
    opt = OSS(model.parameters(), optim=torch.optim.SGD, group=mine, lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)

    for m, o in ((model, opt), (ref, ref_opt)):
        train_harness_model("nested", m, o, rank, range(2), after_backward=lambda m=m: average_grads(m, group=mine))
    opt.consolidate_state_dict(recipient_rank=1)
    out = {"diff": max_param_diff(model, ref), "group_rank": float(opt.rank), "global_rank": float(opt.global_rank)}
    if opt.rank == 1:
        out["state_matches"] = float(same_optimizer_state(opt.state_dict(), ref_opt.state_dict()))
    return out


def test_oss_on_subgroups() -> None:
    results = run_distributed(_subgroups, 4)
    assert [(r["group_rank"], r["global_rank"]) for r in results] == [(0, 0), (1, 1), (0, 2), (1, 3)]
    assert all(r["diff"] <= 1e-6 for r in results)
    assert [r.get("state_matches") for r in results] == [None, 1.0, None, 1.0]
