"""smp models under tensor parallelism in shardkit's universal checkpoint (issue 34, item 4): each tensor-parallel
rank stores its slices as boxes of the full tensors (nothing gathered), and the checkpoint loads at another layout
(TP 2 -> TP 1, TP 1 -> TP 2, TP 2 -> a plain module) with the saver's weights and Adam state bit for bit, the next
step's loss equal to the saver's uninterrupted run.

The model mixes both kinds of split the adapters must find: ``smp.nn.DistributedLinear`` (a layer of the
tensor-parallel core), and ``smp.nn.DistributedEmbedding`` and ``DistributedTransformerOutputLayer`` (smp modules
naming their slices themselves, along dimension 0 and 1 of nested ``nn.Linear`` weights), plus replicated norms.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file
from smp_testlib import tiny_gpt2_config
from torch import nn

import shardkit.modelparallel as smp
from shardkit.checkpoint import load_checkpoint, save_checkpoint
from shardkit.checkpoint.tools.export import export_safetensors
from shardkit.checkpoint.tools.inspect import inspect_checkpoint
from shardkit.modelparallel.tp.state_dicts import merge_tp_slices
from shardkit.testing import run_distributed

VOCAB, HIDDEN, FF, SEQ, BATCH = 16, 8, 16, 4, 4
#: The next step's loss at another tensor-parallel degree: float32 sums in another order.
TOL = 2e-6


class Net(nn.Module):
    """Split embedding (smp module, dimension 1), a split feed-forward block (smp module, dimensions 0 and 1), a
    replicated norm and a split head (core layer, dimension 1). Built after ``smp.init`` (whole at degree 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = smp.nn.DistributedEmbedding(VOCAB, HIDDEN)
        self.ffn = smp.nn.DistributedTransformerOutputLayer(
            hidden_size=HIDDEN, intermediate_size=FF, hidden_dropout_prob=0.0
        )
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = smp.nn.DistributedLinear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.norm(self.ffn(self.emb(ids))))
        return out


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


@smp.step
def _train(model: smp.DistributedModel, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(ids).reshape(-1, VOCAB), targets.reshape(-1))
    model.backward(loss)
    return loss


def _config(tp: int, pp: int = 1, sdp: int = 1) -> dict[str, Any]:
    # Every rank takes the whole batch (prescaled: the tensor-parallel ranks share it; the data-parallel replicas
    # average equal gradients exactly), so every layout trains on the same data.
    return {
        "tensor_parallel_degree": tp,
        "pipeline_parallel_degree": pp,
        "sharded_data_parallel_degree": sdp,
        # smp clips at optimizer.step() under sharded data parallelism only (by default at 1.0): never, so that
        # every layout takes the same step
        **({"sdp_gradient_clipping": 1e9} if sdp > 1 else {}),
        "ddp": True,
        "prescaled_batch": True,
        "microbatches": 1,
        "optimize": "speed",
    }


def _step(model: smp.DistributedModel, optimizer: Any, step: int) -> float:
    optimizer.zero_grad()
    loss = _train(model, *_batch(step)).reduce_mean().item()
    optimizer.step()
    return float(loss)


def _weights(model: smp.DistributedModel) -> dict[str, torch.Tensor]:
    """The whole weights, copied (without tensor parallelism ``state_dict()`` may hand out the live tensors)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _full_state(model: smp.DistributedModel, optimizer: Any) -> dict[str, Any]:
    """The whole weights and the whole Adam state by parameter name (the tensor-parallel slices merged); under
    sharded data parallelism (the optimizer steps flat shards) the weights only."""
    if model.stage_execution is not None and model.stage_execution.sharded is not None:
        return {"model": _weights(model)}
    names = {id(p): n for n, p in model.module.named_parameters()}
    inner = optimizer.optimizer
    adam: dict[str, Any] = {}
    for key in ("exp_avg", "exp_avg_sq"):
        local = {names[id(p)]: s[key].detach().clone() for p, s in inner.state.items()}
        adam[key] = merge_tp_slices(local, model.module)
    steps = {names[id(p)]: float(s["step"]) for p, s in inner.state.items()}
    if smp.pp_size() > 1:  # every stage's part
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (adam, steps))
        adam = {key: {k: v for part, _ in parts for k, v in part[key].items()} for key in adam}
        steps = {k: v for _, part in parts for k, v in part.items()}
    return {"model": _weights(model), "adam": adam, "steps": steps}


def _smp_run(
    tp: int, directory: Path, save: bool, pp: int = 1, sdp: int = 1, before_partition: bool = False
) -> dict[str, Any]:
    """At degree ``tp`` (with ``pp`` pipeline stages, ``sdp``-way sharded data parallelism): save after one Adam
    step (``save``) and go on one more step, or load into a fresh model (another seed; after a step of its own,
    or ``before_partition``, when smp keeps the optimizer state until the first step) and take that step. The state
    right after the save or load, the next step's loss and the weights after it (moved by the loaded Adam state)."""
    smp.init(_config(tp, pp, sdp))
    try:
        torch.manual_seed(0 if save else 7)
        model = smp.DistributedModel(Net())
        optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
        if save:
            _step(model, optimizer, 0)
            save_checkpoint(directory, step=1, model=model, optimizer=optimizer)
        elif before_partition:
            load_checkpoint(directory, model=model, optimizer=optimizer)
        else:
            _step(model, optimizer, 5)  # partitioned, with optimizer state to overwrite
            load_checkpoint(directory, model=model, optimizer=optimizer)
        # the optimizer state loaded before the partition is only applied then: checked by the step after it
        state = {"model": _weights(model)} if before_partition else _full_state(model, optimizer)
        loss = _step(model, optimizer, 1)
        return {**state, "loss": loss, "after": model.state_dict()}
    finally:
        smp.reset()


def _plain_load(directory: Path) -> dict[str, Any]:
    """The checkpoint loaded into the unwrapped module (built at degree 1, never given to smp) and torch's Adam."""
    smp.init({"ddp": True})
    try:
        torch.manual_seed(9)
        net = Net()
        optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
        load_checkpoint(directory, model=net, optimizer=optimizer)
        names = {id(p): n for n, p in net.named_parameters()}
        adam = {key: {names[id(p)]: s[key] for p, s in optimizer.state.items()} for key in ("exp_avg", "exp_avg_sq")}
        steps = {names[id(p)]: float(s["step"]) for p, s in optimizer.state.items()}
        return {"model": net.state_dict(), "adam": adam, "steps": steps}
    finally:
        smp.reset()


def _differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Names whose weights, Adam moments or step counts are not bit-identical (or missing)."""
    bad = [k for k in want["model"] if k not in got["model"] or not torch.equal(got["model"][k], want["model"][k])]
    for key in ("exp_avg", "exp_avg_sq") if "adam" in got and "adam" in want else ():
        mine, theirs = got["adam"][key], want["adam"][key]
        bad += [f"{key}:{k}" for k in theirs if k not in mine or not torch.equal(mine[k], theirs[k])]
    if got.get("steps", want.get("steps")) != want.get("steps", got.get("steps")):
        bad.append("steps")
    return bad


def _moves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    base = Path(root)
    out: dict[str, Any] = {}
    out["tp2"] = _smp_run(2, base / "tp2", save=True)
    out["tp1"] = _smp_run(1, base / "tp1", save=True)
    out["tp2->tp1"] = _smp_run(1, base / "tp2", save=False)
    out["tp1->tp2"] = _smp_run(2, base / "tp1", save=False)
    out["tp2->tp2"] = _smp_run(2, base / "tp2", save=False)
    out["tp2->plain"] = _plain_load(base / "tp2")
    out["tp2->tp1 before the partition"] = _smp_run(1, base / "tp2", save=False, before_partition=True)
    return out


def _check(results: list[dict[str, Any]], moves: dict[str, Optional[float]]) -> None:
    for rank, out in enumerate(results):
        for move, tol in moves.items():
            source = out[move.split("->")[0]]
            bad = _differences(out[move], source)
            assert not bad, (rank, move, bad)
            if tol is not None:
                assert abs(out[move]["loss"] - source["loss"]) <= tol, (rank, move, out[move]["loss"], source["loss"])
                after = max((out[move]["after"][k] - v).abs().max().item() for k, v in source["after"].items())
                assert after <= tol, (rank, move, after)


def test_tp2_checkpoint_loads_at_tp1_tp2_and_into_a_plain_module_and_tp1_at_tp2(tmp_path: Path) -> None:
    results = run_distributed(_moves, 2, str(tmp_path))
    assert results[0]["tp2"]["model"]["head.weight"].shape == (VOCAB, HIDDEN)  # merged: the whole tensors compared
    # Each rank's slice is its own chunk of the full-shaped tensor (nothing was gathered), the Adam state alike.
    tensors = {t["key"]: t for t in inspect_checkpoint(tmp_path / "tp2")["tensors"]}
    for key, shape in [("emb.weight", [VOCAB, HIDDEN]), ("ffn.dense2.weight", [HIDDEN, FF]), ("head.weight", None)]:
        assert tensors[f"model/{key}"]["chunks"] == 2 == tensors[f"optim/{key}/exp_avg"]["chunks"], key
        assert shape is None or tensors[f"model/{key}"]["shape"] == shape, tensors[f"model/{key}"]
    _check(
        results,
        {"tp2->tp2": 0.0, "tp2->tp1": TOL, "tp1->tp2": TOL, "tp2->plain": None, "tp2->tp1 before the partition": TOL},
    )


def _pipeline_moves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    base = Path(root)
    out: dict[str, Any] = {}
    out["tp2pp2"] = _smp_run(2, base / "tp2pp2", save=True, pp=2)
    out["tp2pp2->tp2"] = _smp_run(2, base / "tp2pp2", save=False)  # x reduced data 2
    out["tp2pp2->tp2pp2"] = _smp_run(2, base / "tp2pp2", save=False, pp=2)
    out["tp2pp2->tp2pp2 before the partition"] = _smp_run(2, base / "tp2pp2", save=False, pp=2, before_partition=True)
    return out


def test_tp2_x_pp2_checkpoint_loads_at_tp2_without_a_pipeline(tmp_path: Path) -> None:
    results = run_distributed(_pipeline_moves, 4, str(tmp_path))
    _check(results, {"tp2pp2->tp2pp2": 0.0, "tp2pp2->tp2": TOL, "tp2pp2->tp2pp2 before the partition": 0.0})


def _gpt2_tp2(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A Hugging Face GPT-2 split by ``smp.model_creation(tensor_parallelism=True)`` at TP 2: one Adam step, save;
    then the checkpoint loaded into the plain Hugging Face model and torch's Adam."""
    transformers = pytest.importorskip("transformers")
    directory = Path(root) / "gpt2"
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(3))
    smp.init(_config(2))
    try:
        torch.manual_seed(0)
        with smp.model_creation(tensor_parallelism=True):
            net = transformers.GPT2LMHeadModel(tiny_gpt2_config(positions=8))
        model = smp.DistributedModel(net)
        optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))

        @smp.step
        def train(model: smp.DistributedModel, ids: torch.Tensor) -> torch.Tensor:
            loss = model(input_ids=ids, labels=ids)["loss"]
            model.backward(loss)
            return loss

        train(model, ids)
        optimizer.step()
        save_checkpoint(directory, step=1, model=model, optimizer=optimizer)
        saved = _full_state(model, optimizer)
        split = type(net.transformer.h[0].mlp.c_fc).__name__
    finally:
        smp.reset()
    torch.manual_seed(5)
    plain = transformers.GPT2LMHeadModel(tiny_gpt2_config(positions=8))
    adam = torch.optim.Adam(plain.parameters(), lr=0.01)
    load_checkpoint(directory, model=plain, optimizer=adam)
    names = {id(p): n for n, p in plain.named_parameters()}
    moments = {key: {names[id(p)]: s[key] for p, s in adam.state.items()} for key in ("exp_avg", "exp_avg_sq")}
    steps = {names[id(p)]: float(s["step"]) for p, s in adam.state.items()}
    loaded = {"model": plain.state_dict(), "adam": moments, "steps": steps}
    return {"bad": _differences(loaded, saved), "split": split, "saved": saved["model"]}


def test_hf_gpt2_split_by_model_creation_loads_into_the_plain_model_and_exports(tmp_path: Path) -> None:
    results = run_distributed(_gpt2_tp2, 2, str(tmp_path))
    assert [r["bad"] for r in results] == [[], []] and results[0]["split"] == "Conv1DColumnParallel", results
    [exported] = export_safetensors(tmp_path / "gpt2", tmp_path / "gpt2.safetensors")
    whole = load_file(str(exported))
    saved = results[0]["saved"]
    assert all(torch.equal(whole[k], saved[k]) for k in whole) and set(saved) - set(whole) <= {"lm_head.weight"}


def _sharded_moves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    base = Path(root)
    out: dict[str, Any] = {}
    out["tp2sdp2"] = _smp_run(2, base / "tp2sdp2", save=True, sdp=2)
    out["tp2"] = _smp_run(2, base / "tp2", save=True)  # x reduced data 2
    out["tp2sdp2->tp2"] = _smp_run(2, base / "tp2sdp2", save=False)
    out["tp2sdp2->tp2sdp2"] = _smp_run(2, base / "tp2sdp2", save=False, sdp=2)
    out["tp2->tp2sdp2"] = _smp_run(2, base / "tp2", save=False, sdp=2)
    return out


def test_tp2_x_sharded_data_parallel_stores_smp_modules_slices_whole_shaped(tmp_path: Path) -> None:
    """Under sharded data parallelism the stage is FSDP's; smp's distributed modules' slices (which the core's layers
    do not report) must still be stored as parts of the full tensors."""
    results = run_distributed(_sharded_moves, 4, str(tmp_path))
    _check(results, {"tp2sdp2->tp2sdp2": 0.0, "tp2sdp2->tp2": TOL, "tp2->tp2sdp2": TOL})
    shapes = {t["key"]: t["shape"] for t in inspect_checkpoint(tmp_path / "tp2sdp2")["tensors"]}
    assert shapes["model/emb.weight"] == [VOCAB, HIDDEN] and shapes["model/ffn.dense1.weight"] == [FF, HIDDEN]


def test_bf16_optimizer_is_refused_and_a_model_only_load_refreshes_the_masters(tmp_path: Path) -> None:
    """Under bf16 the optimizer steps FP32 masters the universal layout does not hold: saving them is refused before
    anything is written (it stored the bf16 weights and silently dropped the Adam state). The model alone saves, and
    loading it gives the masters the loaded weights (they kept the old ones: training went on from those)."""
    smp.reset()
    smp.init({"bf16": True})
    try:
        torch.manual_seed(0)
        model = smp.DistributedModel(Net())
        optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
        _step(model, optimizer, 0)
        with pytest.raises(ValueError, match="'fp16'/'bf16' are not supported yet"):
            save_checkpoint(tmp_path / "refused", step=1, model=model, optimizer=optimizer)
        assert not (tmp_path / "refused").exists()
        save_checkpoint(tmp_path / "model", step=1, model=model)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        _step(model, optimizer, 1)
        load_checkpoint(tmp_path / "model", model=model)
        masters = [m for group in optimizer.fp32_from_fp16_groups for m in group]
        params = [p for group in optimizer.fp16_groups for p in group]
        assert all(torch.equal(m.to(p.dtype), p) for m, p in zip(masters, params))
        assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    finally:
        smp.reset()
