"""``shardkit.models.tp_lm`` split at tensor-parallel 2 computes what the unsplit model computes, with separate and
with fused (stride-3) ``q``/``k``/``v`` projections; planned, the fused blocks all-reduce twice per direction."""

from __future__ import annotations

import functools

import pytest
import torch

from shardkit import tensor_parallel as tp
from shardkit.models.tp_lm import tp_comm_bytes, tp_lm
from shardkit.plan import estimate
from shardkit.plan.workloads import next_token_cross_entropy
from shardkit.testing import run_distributed

SIZES = {"vocab": 64, "dim": 32, "heads": 4, "layers": 2}


def _split_equals_unsplit(rank: int, world_size: int) -> dict[str, float]:
    tp.init_parallel_state(tensor=2)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    errors = {}
    for fused in (False, True):
        torch.manual_seed(3)
        full = tp_lm(parallel=False, fused=fused, **SIZES)
        split = tp_lm(parallel=True, fused=fused, **SIZES)
        split.load_state_dict(tp.split_state_dict(full.state_dict(), tp.tp_sharding(split), 2)[rank])
        want, got = full(tokens), split(tokens)
        next_token_cross_entropy(got, (tokens,)).backward()
        next_token_cross_entropy(want, (tokens,)).backward()
        grads = tp.split_state_dict({k: p.grad for k, p in full.named_parameters()}, tp.tp_sharding(split), 2)[rank]
        grad_error = max((p.grad - grads[k]).abs().max().item() for k, p in split.named_parameters())
        errors[f"fused={fused}"] = max((got - want).abs().max().item(), grad_error)
    tp.set_current_state(None)
    return errors


@pytest.mark.multi
def test_tp_lm_at_tensor_parallel_2_equals_the_unsplit_model() -> None:
    for errors in run_distributed(_split_equals_unsplit, 2):
        assert max(errors.values()) < 1e-5, errors


@pytest.mark.single  # the planner's peerless world is a process group in this process
def test_fused_blocks_are_planned_with_two_all_reduces_per_block_each_way() -> None:
    build = functools.partial(tp_lm, fused=True, dim=64, layers=2)
    batch = (torch.randint(0, 512, (2, 16)),)
    est = estimate(
        build, batch, loss_fn=next_token_cross_entropy, strategy="fsdp", world_size=4, tensor_parallel=2,
        backend="gloo",
    )  # fmt: skip
    want = tp_comm_bytes(2, 16, 64, 2, 2, fused=True)
    assert want["forward"] == want["backward"] > 0
    got = est.comm_bytes_by_phase
    assert (got["forward"]["all_reduce"], got["backward"]["all_reduce"]) == (want["forward"], want["backward"])
