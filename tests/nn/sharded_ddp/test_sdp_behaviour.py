"""What ShardedDataParallel does besides matching DDP: where gradients live, when communication happens, how many
bytes travel, and what is synchronised. All checks run in one 2-rank launch."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.distributed as dist

from shardkit.distributed import count_comm_bytes
from shardkit.nn import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing import run_distributed
from shardkit.testing.models import loss_for
from testkit import average_grads, rank_batch, tiny_model


def _backward(model: ShardedDataParallel, rank: int, step: int = 0, name: str = "lm") -> None:
    x, y = rank_batch(name, model, rank, step)
    loss_for(name, model(x), y).backward()


def _gradient_memory(rank: int) -> dict[str, Any]:
    """After backward a rank holds exactly the gradients of the parameters it owns; reduces overlap backward."""
    model = tiny_model("lm")
    oss = OSS(model.parameters(), lr=0.1)
    sdp = ShardedDataParallel(model, oss, reduce_buffer_size=2048)
    _backward(sdp, rank)
    owned = [p for p, owner in oss.param_to_rank.items() if owner == rank]
    held = [p for p in model.parameters() if p.grad is not None]
    stats = sdp.reduce_stats
    assert stats is not None
    return {
        "holds_exactly_owned": {id(p) for p in held} == {id(p) for p in owned},
        "grad_fraction": sum(p.numel() for p in held) / sum(p.numel() for p in model.parameters()),
        "launched_during_backward": stats.launched_during_backward,
        "launched_at_end": stats.launched_at_end,
        "units": len(sdp._reducer.units),
    }


def _no_sync_is_silent(rank: int) -> dict[str, Any]:
    model = tiny_model("lm")
    sdp = ShardedDataParallel(model, OSS(model.parameters(), lr=0.1))
    with count_comm_bytes() as quiet, sdp.no_sync():
        _backward(sdp, rank, 0)
    kept_all = all(p.grad is not None for p in model.parameters())  # accumulation keeps every local gradient
    with count_comm_bytes() as loud:
        _backward(sdp, rank, 1)
    return {"quiet_calls": dict(quiet.calls), "loud_reduces": loud.calls.get("reduce", 0), "kept_all": kept_all}


def _fp16_reduction(rank: int) -> dict[str, Any]:
    """reduce_fp16 halves the reduced bytes and stays close to the fp32 result."""
    results = {}
    for fp16 in (False, True):
        model = tiny_model("lm")
        oss = OSS(model.parameters(), lr=0.1)
        sdp = ShardedDataParallel(model, oss, reduce_fp16=fp16)
        with count_comm_bytes() as meter:
            _backward(sdp, rank)
        grads = {i: p.grad for i, p in enumerate(model.parameters()) if p.grad is not None}
        results[fp16] = (meter.payload_bytes["reduce"], grads)
    (bytes32, g32), (bytes16, g16) = results[False], results[True]
    worst = max(((g32[i] - g16[i]).abs().max() / g32[i].abs().max().clamp_min(1e-12)).item() for i in g32)
    dtypes = {g.dtype for g in g16.values()}
    return {"ratio": bytes16 / bytes32, "same_owned": g32.keys() == g16.keys(), "rel_err": worst, "dtypes": dtypes}


def _startup_and_buffers(rank: int) -> dict[str, Any]:
    """Rank 0's parameters win at construction; its buffers win at every forward."""
    model = tiny_model("batchnorm", seed=rank)  # different weights per rank
    sdp = ShardedDataParallel(model, OSS(model.parameters(), lr=0.1))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    with torch.no_grad():
        for b in model.buffers():
            b.fill_(rank + 1)
    sdp.eval()
    sdp(torch.randn(2, 8))  # eval: the forward reads the buffers but does not update them
    return {
        "params_equal": torch.equal(gathered[0], gathered[1]),
        "buffers_from_rank0": all(torch.all(b == 1).item() for b in model.buffers()),
    }


def _rewrap(rank: int) -> dict[str, Any]:
    """Wrapping the same model again unhooks the first wrapper, so gradients are reduced once, not twice."""
    model = tiny_model("nested")
    reference = copy.deepcopy(model)
    ShardedDataParallel(model, OSS(model.parameters(), lr=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        oss = OSS(model.parameters(), lr=0.1)
        sdp = ShardedDataParallel(model, oss)
    _backward(sdp, rank, name="nested")
    x, y = rank_batch("nested", reference, rank, 0)
    loss_for("nested", reference(x), y).backward()
    average_grads(reference)
    owned = [(p, q) for p, q in zip(model.parameters(), reference.parameters()) if oss.param_to_rank[p] == rank]
    return {
        "warned": any("already wrapped" in str(w.message) for w in caught),
        "grad_diff": max((p.grad - q.grad).abs().max().item() for p, q in owned),
    }


def _suite(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "rewrap": _rewrap(rank),
        "memory": _gradient_memory(rank),
        "no_sync": _no_sync_is_silent(rank),
        "fp16": _fp16_reduction(rank),
        "startup": _startup_and_buffers(rank),
    }


def test_behaviour_on_two_ranks() -> None:
    for rank, result in enumerate(run_distributed(_suite, 2)):
        memory = result["memory"]
        assert memory["holds_exactly_owned"], f"rank {rank} holds gradients it does not own"
        assert 0.2 < memory["grad_fraction"] < 0.8, memory  # about half of the gradients, balanced by OSS
        assert memory["units"] > 2
        # the reduces start during backward: only the units completed by the last gradients wait for the end
        assert memory["launched_during_backward"] >= memory["units"] - 1, memory
        assert memory["launched_during_backward"] + memory["launched_at_end"] == memory["units"]

        no_sync = result["no_sync"]
        assert "reduce" not in no_sync["quiet_calls"] and "all_reduce" not in no_sync["quiet_calls"], no_sync
        assert no_sync["loud_reduces"] > 0 and no_sync["kept_all"]

        fp16 = result["fp16"]
        assert fp16["ratio"] == 0.5 and fp16["same_owned"]
        assert fp16["dtypes"] == {torch.float32}  # the optimizer still sees fp32 gradients
        assert fp16["rel_err"] < 5e-3, fp16

        assert result["startup"] == {"params_equal": True, "buffers_from_rank0": True}

        assert result["rewrap"]["warned"] and result["rewrap"]["grad_diff"] < 1e-7, result["rewrap"]
