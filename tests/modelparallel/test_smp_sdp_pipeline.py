"""Sharded data parallelism with a pipeline (a shardkit extension: smp refuses it; issue 34's 3-D training).

A tiny Hugging Face GPT-2 (untied embeddings: weights tied across stages are refused) trains with data on the
first stage only, 2 micro-batches, and smp's clipping at ``optimizer.step()``: PP 2 x SDP 2 under the interleaved
(1F1B) and simple (GPipe) schedules, with activation checkpointing and ``backward_passes_per_step=2``, a partial
checkpoint that resumes bit for bit, and PP 2 x TP 2 x SDP 2 on 8 processes. Every micro-batch loss, every global
gradient norm and the final weights equal one plain-torch process training the same model on the same batches.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import pytest
import torch
from smp_testlib import tiny_gpt2_config

import shardkit.checkpoint as universal
import shardkit.modelparallel as smp
from shardkit.testing import run_distributed

transformers = pytest.importorskip("transformers")

# The same model, batches and tolerance as the 3-D layouts without sharding.
from test_smp_tp_hf_layouts import MICROBATCHES, SEED, SEQ, TOL, _tokens  # noqa: E402

CLIP = 0.5
#: Reduced-data-parallel replicas in both layouts (PP 2 on 4 processes, PP 2 x TP 2 on 8).
REPLICAS = 2


def _gpt2(tied: bool = False) -> Any:
    config = tiny_gpt2_config(positions=SEQ)
    config.tie_word_embeddings = tied
    return transformers.GPT2LMHeadModel(config)


def _config(tp: int, pipeline: str) -> dict[str, Any]:
    return {
        "ddp": True,
        "pipeline_parallel_degree": 2,
        "tensor_parallel_degree": tp,
        "sharded_data_parallel_degree": 2,
        "sdp_gradient_clipping": CLIP,
        "microbatches": MICROBATCHES,
        "pipeline": pipeline,
        "prescaled_batch": True,
    }


@smp.step
def _train(model: smp.DistributedModel, ids: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=ids, labels=ids)["loss"]
    model.backward(loss)
    return loss


def _build(config: dict[str, Any], checkpoint: bool, accumulate: int, tied: bool = False) -> tuple[Any, Any, list[int]]:
    """The model, its optimizer, and a counter of the first block's MLP forwards (recomputed where checkpointed)."""
    torch.manual_seed(SEED)
    smp.init(config)
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
        net = _gpt2(tied)
    model = smp.DistributedModel(net, backward_passes_per_step=accumulate)
    if checkpoint:
        for block in model.get_module().transformer.h:
            smp.set_activation_checkpointing(block)
    runs = [0]
    net.transformer.h[0].mlp.register_forward_pre_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    return model, smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)), runs


def _steps(model: Any, optimizer: Any, steps: range, accumulate: int, runs: Optional[list[int]] = None) -> list[Any]:
    """Each step's micro-batch losses (this replica's share, data on the first stage only) and, where the optimizer
    stepped, the global gradient norm smp's step clipped by."""
    out = []
    for step in steps:
        ids = _tokens(step).chunk(smp.rdp_size())[smp.rdp_rank()] if smp.pp_rank() == 0 else torch.empty(0)
        if step % accumulate == 0:
            optimizer.zero_grad()
        if runs is not None:
            runs[0] = 0  # counts the last step's forwards only (the first step's tracing runs the model too)
        losses = [t.item() for t in _train(model, ids).outputs]
        norm: Optional[float] = None
        if (step + 1) % accumulate == 0:
            optimizer.step()
            norm = optimizer._global_grad_norm.item()
        out.append((losses, norm))
    return out


def _reference(steps: int, replicas: int, accumulate: int) -> dict[str, Any]:
    torch.manual_seed(SEED)
    net = _gpt2()
    initial = {k: v.detach().clone() for k, v in net.state_dict().items()}
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    out = []
    for step in range(steps):
        shares = [share.chunk(MICROBATCHES) for share in _tokens(step).chunk(replicas)]
        per_mb = [[net(input_ids=ids, labels=ids).loss for ids in share] for share in shares]
        if step % accumulate == 0:
            optimizer.zero_grad()
        (sum(loss for share in per_mb for loss in share) / (replicas * MICROBATCHES)).backward()  # type: ignore[union-attr]
        norm = None
        if (step + 1) % accumulate == 0:
            norm = torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP).item()
            optimizer.step()
        out.append(([[loss.item() for loss in share] for share in per_mb], norm))
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return {"steps": out, "state": state, "initial": initial}


def _differences(mine: list[Any], state: dict[str, Any], replica: int, theirs: dict[str, Any]) -> dict[str, Any]:
    """The largest loss, norm and weight differences against the reference, and how far its weights moved."""
    loss = norm = 0.0
    assert len(mine) == len(theirs["steps"]) and all(len(got) == MICROBATCHES for got, _ in mine), mine
    for (got, got_norm), (ref, ref_norm) in zip(mine, theirs["steps"]):
        loss = max([loss] + [abs(a - b) for a, b in zip(got, ref[replica])])
        if ref_norm is not None:
            norm = max(norm, abs(got_norm - ref_norm) / ref_norm)
    ref_state = theirs["state"]
    weight = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    moved = max((ref_state[k] - theirs["initial"][k]).abs().max().item() for k in ref_state)
    clipped = all(n is None or n > CLIP for _, n in theirs["steps"])
    return {"loss": loss, "norm": norm, "weight": weight, "moved": moved, "clipped": clipped,
            "keys": sorted(state) == sorted(ref_state)}  # fmt: skip


def _case(tp: int, pipeline: str, checkpoint: bool, accumulate: int, folder: Optional[str]) -> dict[str, Any]:
    """Train 2 optimizer steps (3 with a checkpoint ``folder``: partial and full ones saved after the second, each
    resumed to redo the third)."""
    config = _config(tp, pipeline)
    steps = (3 if folder else 2) * accumulate
    model, optimizer, runs = _build(config, checkpoint, accumulate)
    out: dict[str, Any] = {}
    mine = _steps(model, optimizer, range(2 * accumulate), accumulate, runs)
    # per micro-batch: once on the stage holding the block, twice where checkpointed (again inside backward)
    out["runs"] = runs[0] / (MICROBATCHES * (2 if checkpoint else 1))
    out["shard"] = (sum(p.numel() for p in model.local_parameters()), sum(p.numel() for p in _gpt2().parameters()))
    if folder:
        smp.save_checkpoint(folder, "partial", partial=True, model=model, optimizer=optimizer)
        smp.save_checkpoint(folder, "full", partial=False, model=model)  # the whole model, gathered over the stages
        with pytest.raises(ValueError, match=r"not supported yet: use smp\.save_checkpoint"):  # on every rank
            universal.save_checkpoint(os.path.join(folder, "universal"), step=2, model=model, optimizer=optimizer)
        mine += _steps(model, optimizer, range(2 * accumulate, steps), accumulate)
    state = model.state_dict()
    replica = smp.rdp_rank()
    smp.reset()
    out.update(_differences(mine, state, replica, _reference(steps, REPLICAS, accumulate)))
    if folder:
        model, optimizer, _ = _build(config, checkpoint, accumulate)
        smp.resume_from_checkpoint(folder, tag="partial", partial=True)
        again = _steps(model, optimizer, range(2 * accumulate, steps), accumulate)
        out["resumed"] = again == mine[2 * accumulate :]
        resumed_state = model.state_dict()
        out["resumed_weights"] = all(torch.equal(resumed_state[k], v) for k, v in state.items())
        smp.reset()
        # a full checkpoint restores the weights (not the optimizer): the third step's losses again
        model, optimizer, _ = _build(config, checkpoint, accumulate)
        smp.resume_from_checkpoint(folder, tag="full", partial=False, load_optimizer=False)
        first = _steps(model, optimizer, range(2 * accumulate, 2 * accumulate + 1), accumulate)
        out["resumed_full"] = first[0][0] == mine[2 * accumulate][0]
        smp.reset()
    return out


def _refused_tied(folder: str) -> str:
    """GPT-2 with its embedding tied to the output head on another stage: refused on every rank at the first step."""
    model, _, _ = _build(_config(1, "interleaved"), False, 1, tied=True)
    try:
        _train(model, _tokens(0).chunk(2)[smp.rdp_rank()] if smp.pp_rank() == 0 else torch.empty(0))
    except ValueError as exc:
        return str(exc)
    finally:
        smp.reset()
    return "not refused"


def _four(rank: int, world_size: int, folder: str) -> list[dict[str, Any]]:
    out = [{"refused": _refused_tied(folder)}]
    out.append(_case(1, "interleaved", True, 2, None))
    out.append(_case(1, "simple", False, 1, folder))
    return out


def _check(result: dict[str, Any]) -> None:
    assert result["keys"] and result["moved"] > 1e-3 and result["clipped"], result
    assert result["loss"] <= TOL and result["weight"] <= TOL and result["norm"] <= 1e-5, result
    shard, whole = result["shard"]
    assert result["runs"] in (0, 1), result  # 0 on the stage without the block
    assert shard < whole * 0.4, result["shard"]  # each rank holds about half of its stage (about half the model)


def test_pp2_x_sdp2_equals_plain_torch_and_resumes_bit_identically(tmp_path: Any) -> None:
    """PP 2 x SDP 2 (4 processes): interleaved 1F1B with activation checkpointing and two backward passes per step,
    then the simple schedule with a partial checkpoint resumed."""
    results = run_distributed(_four, 4, str(tmp_path))
    for result in results:
        assert "used on several stages" in result[0]["refused"], result[0]
        for case in result[1:]:
            _check(case)
        assert result[2]["resumed"] and result[2]["resumed_weights"] and result[2]["resumed_full"], result[2]
    assert max(result[1]["runs"] for result in results) == 1  # the block ran (and was recomputed) on its stage


def _eight(rank: int, world_size: int) -> dict[str, Any]:
    return _case(2, "interleaved", True, 2, None)


def test_3d_pp2_x_tp2_x_sdp2_equals_plain_torch() -> None:
    """PP 2 x TP 2 x SDP 2 on 8 processes, activation checkpointing, two backward passes per step."""
    results = run_distributed(_eight, 8)
    for result in results:
        _check(result)
    assert max(result["runs"] for result in results) == 1
