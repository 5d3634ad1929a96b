"""smp's sharded data parallelism (``sharded_data_parallel_degree``, issue 34) on shardkit's FSDP: smp's rules refused
before anything is built, training equal to one plain-torch process (with smp's clipping at ``optimizer.step()``)
alone and under tensor parallelism, and partial and full checkpoints that resume bit for bit."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from smp_testlib import tiny_gpt2_config
from torch import nn

import shardkit.modelparallel as smp
from shardkit.modelparallel.optimizers import FusedLamb
from shardkit.modelparallel.sdp.groups import sharding_ranks
from shardkit.testing import run_distributed

#: The sharded-data-parallel keys of AWS's GPT-NeoX script (with the smp docs' defaults for the others).
AWS_KEYS = {
    "ddp": True,
    "sharded_data_parallel_degree": 2,
    "sdp_reduce_bucket_size": int(5e8),
    "sdp_param_persistence_threshold": int(1e6),
    "sdp_max_live_parameters": int(1e9),
    "sdp_hierarchical_allgather": False,
    "sdp_gradient_clipping": 0.5,
}


def test_sdp_keys_and_smps_rules_are_checked_before_anything_is_built() -> None:
    cfg = smp.ModelParallelConfig.from_dict({**AWS_KEYS, "sdp_gradient_clipping": "0.5"})
    got = (cfg.sharded_data_parallel_degree, cfg.sdp_gradient_clipping, cfg.sdp_hierarchical_allgather)
    assert got == (2, 0.5, False)
    refusals = {
        "needs 'ddp': True": {"sharded_data_parallel_degree": 2},
        "one chunk per rank under the interleaved or simple": {**AWS_KEYS, "partitions": 2, "pipeline": "zero_bubble"},
        "one chunk per rank": {**AWS_KEYS, "partitions": 2, "virtual_stages": 2, "microbatches": 4},
        "not support it with shard_optimizer_state": {**AWS_KEYS, "shard_optimizer_state": True},
        "'bf16' together with a pipeline is not built yet": {**AWS_KEYS, "partitions": 2, "bf16": True},
        "'sdp_gradient_clipping' must be > 0": {**AWS_KEYS, "sdp_gradient_clipping": 0},
        "'sharded_data_parallel_degree' must be an int >= 1": {"sharded_data_parallel_degree": 0},
    }
    for message, config in refusals.items():
        with pytest.raises(ValueError, match=message):
            smp.ModelParallelConfig.from_dict(config)
    smp.reset()
    with pytest.raises(ValueError, match="must divide the data-parallel degree 1"):
        smp.init(AWS_KEYS)  # one process
    assert not smp.is_initialized()
    assert sharding_ranks([0, 2, 4, 6], 2) == ([[0, 2], [4, 6]], [[0, 4], [2, 6]])


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 12), nn.LayerNorm(12), nn.Tanh(), nn.Linear(12, 3))


def _param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Weight decay on the matrices only, as AWS's GPT scripts group their parameters."""
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for _, p in named if p.dim() <= 1], "weight_decay": 0.0},
    ]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


@smp.step
def _train(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


def _build(config: dict[str, Any], tp: bool = False) -> tuple[smp.DistributedModel, Any]:
    smp.init(config)
    torch.manual_seed(0)
    with smp.tensor_parallelism(enabled=tp):
        net = _net()
    model = smp.DistributedModel(net)
    return model, smp.DistributedOptimizer(torch.optim.AdamW(_param_groups(model), lr=0.05))


def _smp_steps(model: smp.DistributedModel, optimizer: Any, steps: range, parts: int, index: int) -> list[Any]:
    """Each step's loss over the whole batch and the global gradient norm smp's step clipped by."""
    out = []
    for step in steps:
        x, y = _batch(step)
        optimizer.zero_grad()
        loss = _train(model, x.chunk(parts)[index], y.chunk(parts)[index]).reduce_mean()
        optimizer.step()
        losses = smp.allgather(loss.item(), smp.DP_GROUP)
        out.append((sum(losses) / len(losses), optimizer._global_grad_norm.item()))
    return out


def _reference(steps: int, max_norm: float) -> tuple[list[Any], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    net = _net()
    optimizer = torch.optim.AdamW(_param_groups(net), lr=0.05)
    out = []
    for step in range(steps):
        x, y = _batch(step)
        optimizer.zero_grad()
        loss = F.mse_loss(net(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
        optimizer.step()
        out.append((loss.item(), norm.item()))
    return out, {k: v.detach().clone() for k, v in net.state_dict().items()}


def _sdp_alone(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """SDP 2 on 2 processes (2 micro-batches): 3 steps, a partial and a full checkpoint after the second, and
    resumes from each that redo the third."""
    out: dict[str, Any] = {}
    try:  # a degree that does not divide the replicas: refused at init on every rank
        smp.init({**AWS_KEYS, "sharded_data_parallel_degree": 4})
    except ValueError as exc:
        out["refused"] = str(exc)
    config = {**AWS_KEYS, "microbatches": 2}
    model, optimizer = _build(config)
    full_numel = sum(p.numel() for p in _net().parameters())
    out["losses"] = _smp_steps(model, optimizer, range(2), 2, smp.rdp_rank())
    out["shard_numel"] = (sum(p.numel() for p in model.local_parameters()), full_numel)
    smp.save_checkpoint(folder, "partial", partial=True, model=model, optimizer=optimizer, user_content={"s": 2})
    with pytest.warns(UserWarning, match="without the optimizer state"):
        smp.save_checkpoint(folder, "full", partial=False, model=model, optimizer=optimizer)
    out["losses"] += _smp_steps(model, optimizer, range(2, 3), 2, smp.rdp_rank())
    with pytest.raises(ValueError, match=r"model.cpu\(\) under sharded data parallelism"):
        model.cpu()
    with pytest.raises(ValueError, match="FusedLamb's global gradient norm"):
        smp.DistributedOptimizer(FusedLamb(model.parameters()))
    with pytest.raises(ValueError, match="each rank holds the state of its shards only"):
        optimizer.state_dict()
    out["final"] = model.state_dict()
    out["files"] = sorted(os.listdir(os.path.join(folder, "partial_partial")))
    local = model.local_state_dict()  # smp.save/load of a partial state dict: one file per shard
    smp.save(local, os.path.join(folder, "local.pt"), partial=True)
    smp.barrier()
    loaded = smp.load(os.path.join(folder, "local.pt"), partial=True)
    same = {k: torch.equal(torch.as_tensor(v), torch.as_tensor(loaded[k])) for k, v in local.items()}
    out["save_load"] = sorted(k for k, equal in same.items() if not equal)
    smp.reset()
    for partial in (True, False):
        model, optimizer = _build(config)
        tag = "partial" if partial else "full"
        smp.resume_from_checkpoint(folder, tag=tag, partial=partial, load_optimizer=partial)
        out["resumed", partial] = _smp_steps(model, optimizer, range(2, 3), 2, smp.rdp_rank())
        out["resumed_final", partial] = model.state_dict()
        smp.reset()
    return out


def test_sharded_data_parallel_trains_and_resumes_like_one_process(tmp_path: Any) -> None:
    theirs, weights = _reference(3, AWS_KEYS["sdp_gradient_clipping"])
    for result in run_distributed(_sdp_alone, 2, str(tmp_path)):
        assert "must divide the data-parallel degree 2" in result["refused"], result["refused"]
        for (loss, norm), (ref_loss, ref_norm) in zip(result["losses"], theirs):
            assert abs(loss - ref_loss) < 1e-6 and abs(norm - ref_norm) < 1e-5, (result["losses"], theirs)
        assert ref_norm > AWS_KEYS["sdp_gradient_clipping"]  # the clipping changed the step
        shard, whole = result["shard_numel"]
        assert shard < whole * 0.75, result["shard_numel"]  # each rank holds about half of each parameter
        for name, value in weights.items():
            assert torch.allclose(result["final"][name], value, atol=1e-6), name
        assert result["save_load"] == [], result["save_load"]
        assert result["files"] == ["model_0_0_0.pt", "model_0_0_1.pt", "optimizer_0_0_0.pt", "optimizer_0_0_1.pt",
                                   "user_content.pt"]  # fmt: skip
        # A partial checkpoint resumes bit for bit; a full one restores the weights (not the optimizer state).
        assert result["resumed", True] == result["losses"][2:]
        assert all(torch.equal(result["resumed_final", True][k], v) for k, v in result["final"].items())
        assert result["resumed", False][0][0] == result["losses"][2][0]  # same weights before the third step
        plain = _net()
        plain.load_state_dict(result["resumed_final", False])  # a full checkpoint's model loads into a plain one


def _sdp_on_four(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """On 4 processes: TP 2 x SDP 2 (each tensor-parallel rank's own batch, then one batch per tensor-parallel group)
    and SDP 2 x 2 sharding groups that replicate each other; 3 steps of each. At TP 2 x SDP 2 a partial and a full
    checkpoint after the second step, and resumes from each that redo the third."""
    out: dict[str, Any] = {}
    layouts = {
        "tp": {**AWS_KEYS, "tensor_parallel_degree": 2},
        "tp_prescaled": {**AWS_KEYS, "tensor_parallel_degree": 2, "prescaled_batch": True},
        "replicas": AWS_KEYS,
    }
    for name, config in layouts.items():
        model, optimizer = _build(config, tp=name != "replicas")
        if name == "tp":
            out["split"] = [type(m).__name__ for m in model.module]
        parts, index = (smp.rdp_size(), smp.rdp_rank()) if name == "tp_prescaled" else (smp.dp_size(), smp.dp_rank())
        out[name] = _smp_steps(model, optimizer, range(2), parts, index)
        if name == "tp":
            smp.save_checkpoint(folder, "partial", partial=True, model=model, optimizer=optimizer)
            smp.save_checkpoint(folder, "full", partial=False, model=model)  # as AWS's scripts save full models
        out[name] += _smp_steps(model, optimizer, range(2, 3), parts, index)
        out[name, "final"] = model.state_dict()
        smp.reset()
    out["files"] = sorted(os.listdir(os.path.join(folder, "partial_partial")))
    for partial in (True, False):
        model, optimizer = _build(layouts["tp"], tp=True)
        tag = "partial" if partial else "full"
        smp.resume_from_checkpoint(folder, tag=tag, partial=partial, load_optimizer=partial)
        out["resumed", partial] = _smp_steps(model, optimizer, range(2, 3), smp.dp_size(), smp.dp_rank())
        smp.reset()
    out["hf"] = _hf_gpt2_tp_sdp()
    return out


def _hf_gpt2_tp_sdp() -> list[float]:
    """HF GPT-2 split by smp.tensor_parallelism (TP 2, prescaled_batch as AWS's scripts set it) x SDP 2: 2 steps."""
    import transformers
    from test_smp_gpt2_script import SEED, _param_groups, _tokens

    from shardkit.modelparallel.building.delayed_init import materialize

    torch.manual_seed(SEED)
    smp.init({**AWS_KEYS, "tensor_parallel_degree": 2, "prescaled_batch": True, "sdp_gradient_clipping": 1.0})
    net = transformers.AutoModelForCausalLM.from_config(tiny_gpt2_config(positions=8))
    materialize(net, lambda name: True, torch.device("cpu"), SEED)  # the reference's initial weights
    smp.set_tensor_parallelism(net, True)
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(_param_groups(model.module), lr=0.01, weight_decay=0.01))

    @smp.step
    def step(model: smp.DistributedModel, ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)["loss"]
        model.backward(loss)
        return loss

    logged = []
    for tokens in _tokens(1).flatten(0, 2).chunk(4)[:2]:
        optimizer.zero_grad(set_to_none=True)
        loss = step(model, tokens.chunk(smp.rdp_size())[smp.rdp_rank()]).reduce_mean()
        optimizer.step()
        losses = smp.allgather(loss.item(), smp.RDP_GROUP)
        logged.append(sum(losses) / len(losses))
    smp.reset()
    return logged


def test_sharded_data_parallel_with_tensor_parallelism_and_replicas_trains_like_one_process(tmp_path: Any) -> None:
    theirs, weights = _reference(3, AWS_KEYS["sdp_gradient_clipping"])
    pytest.importorskip("transformers")
    from test_smp_gpt2_script import _reference as gpt2_reference

    gpt2 = [sum(losses) / len(losses) for losses in [step[0] for step in gpt2_reference(1)][:2]]
    for result in run_distributed(_sdp_on_four, 4, str(tmp_path)):
        assert max(abs(a - b) for a, b in zip(result["hf"], gpt2)) < 1e-6, (result["hf"], gpt2)
        assert result["files"] == [f"{kind}_0_{tp}_{shard}.pt" for kind in ("model", "optimizer") for tp in (0, 1)
                                   for shard in (0, 1)] + ["user_content.pt"]  # fmt: skip
        assert result["resumed", True] == result["tp"][2:]  # a partial checkpoint: bit for bit
        assert abs(result["resumed", False][0][0] - result["tp"][2][0]) < 1e-7  # a full one: the same weights
        assert result["split"] == ["DistributedLinear", "LayerNorm", "Tanh", "DistributedLinear"]
        for name in ("tp", "tp_prescaled", "replicas"):
            for (loss, norm), (ref_loss, ref_norm) in zip(result[name], theirs):
                assert abs(loss - ref_loss) < 1e-6 and abs(norm - ref_norm) < 1e-5, (name, result[name], theirs)
            final = result[name, "final"]
            assert set(final) == set(weights), (name, sorted(final))
            for key, value in weights.items():
                assert torch.allclose(final[key], value, atol=1e-6), (name, key, final[key], value)


def _universal(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """A universal checkpoint (``shardkit.checkpoint``) saved under SDP 2 after 2 steps, loaded before the first step
    into plain smp data parallelism and into SDP 2 again; each then runs the third step."""
    from shardkit.checkpoint import load_checkpoint, save_checkpoint

    out: dict[str, Any] = {}
    model, optimizer = _build(AWS_KEYS)
    out["sdp"] = _smp_steps(model, optimizer, range(2), 2, smp.rdp_rank())
    save_checkpoint(folder, step=2, model=model, optimizer=optimizer)
    out["sdp"] += _smp_steps(model, optimizer, range(2, 3), 2, smp.rdp_rank())
    smp.reset()
    for degree in (1, 2):
        model, optimizer = _build({**AWS_KEYS, "sharded_data_parallel_degree": degree})
        load_checkpoint(folder, model=model, optimizer=optimizer)
        if degree == 1:  # plain data parallelism: the script clips (smp only clips at step() under SDP)
            x, y = _batch(2)
            loss = _train(model, x.chunk(2)[smp.rdp_rank()], y.chunk(2)[smp.rdp_rank()]).reduce_mean()
            norm = optimizer.clip_master_grads(AWS_KEYS["sdp_gradient_clipping"])
            optimizer.step()
            losses = smp.allgather(loss.item(), smp.DP_GROUP)
            out[degree] = [(sum(losses) / len(losses), norm.item())]
        else:
            out[degree] = _smp_steps(model, optimizer, range(2, 3), 2, smp.rdp_rank())
        out[degree, "final"] = model.state_dict()
        smp.reset()
    return out


def test_a_universal_checkpoint_of_sdp_loads_into_plain_smp_and_back_into_sdp(tmp_path: Any) -> None:
    for result in run_distributed(_universal, 2, str(tmp_path / "universal")):
        (loss, norm), (plain_loss, plain_norm) = result["sdp"][2], result[1][0]
        assert abs(loss - plain_loss) < 1e-6 and abs(norm - plain_norm) < 1e-5, (result["sdp"], result[1])
        assert result[2] == result["sdp"][2:], (result[2], result["sdp"])  # the same layout: bit for bit
        for key, value in result[1, "final"].items():
            assert torch.allclose(result[2, "final"][key], value, atol=1e-6), key
