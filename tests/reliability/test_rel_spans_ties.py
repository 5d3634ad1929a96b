"""FSDP checkpoints of a model with tied weights (stored once, the tie kept on both sides); checkpoints refused on
every rank with nothing written: asked for inside a forward pass, or of a unit sharded over part of the job only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardkit.checkpoint import load_checkpoint, save_checkpoint
from shardkit.checkpoint.adapters.fsdp import FSDPSource
from shardkit.checkpoint.adapters.smp import SMPSource
from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.testing import run_distributed


class TiedNet(nn.Module):
    """An embedding whose weight is also the output layer's, as in language models."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(tokens))))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, share: int) -> None:
    """One step on ``share`` rows of the batch starting at row ``rank * share``."""
    tokens = torch.arange(8).reshape(4, 2)[rank * share : (rank + 1) * share]
    optimizer.zero_grad()
    F.cross_entropy(model(tokens).reshape(-1, 10), tokens.reshape(-1)).backward()
    optimizer.step()


def _values(model: nn.Module) -> dict[str, Any]:
    return {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}


def _ties(rank: int, world_size: int, root: str) -> dict[str, Any]:
    fsdp = FSDP(TiedNet(seed=0))
    fsdp_opt = torch.optim.SGD(fsdp.parameters(), lr=0.1, momentum=0.9)
    _step(fsdp, fsdp_opt, rank, share=2)
    save_checkpoint(Path(root) / "fsdp", step=0, model=fsdp, optimizer=fsdp_opt)
    plain = TiedNet(seed=1)
    load_checkpoint(Path(root) / "fsdp", model=plain, optimizer=torch.optim.SGD(plain.parameters(), lr=0.1))
    plain_loaded = _values(plain)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    _step(plain, plain_opt, 0, share=4)  # the whole batch: every rank's plain copy stays the same
    save_checkpoint(Path(root) / "plain", step=1, model=plain, optimizer=plain_opt)
    back = FSDP(TiedNet(seed=2))
    load_checkpoint(Path(root) / "plain", model=back, optimizer=torch.optim.SGD(back.parameters(), lr=0.1))
    return {
        "aliases": FSDPSource(fsdp, fsdp_opt).aliases(),
        "fsdp": _values(fsdp),
        "plain_loaded": plain_loaded,
        "plain": _values(plain),
        "plain_still_tied": plain.head.weight is plain.emb.weight,
        "back": _values(back),
    }


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path: Path) -> None:
    results = run_distributed(_ties, 2, str(tmp_path), timeout_s=120)
    for result in results:
        assert result["aliases"] == {"head.weight": "emb.weight"}
        assert result["plain_still_tied"]
        assert set(result["plain_loaded"]) == set(result["fsdp"]) == set(result["back"])
        # FSDP -> plain (tie kept, then a plain step) -> FSDP: both directions carry every name.
        for key, value in result["fsdp"].items():
            assert torch.equal(torch.from_numpy(value), torch.from_numpy(result["plain_loaded"][key])), key
        for key, value in result["back"].items():
            assert torch.equal(torch.from_numpy(value), torch.from_numpy(result["plain"][key])), key
        assert torch.equal(
            torch.from_numpy(result["back"]["head.weight"]), torch.from_numpy(result["back"]["emb.weight"])
        )


def _save_in_forward(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model = FSDP(nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    caught: dict[str, Any] = {}

    def save_now(module: nn.Module, inputs: Any, output: Any) -> None:
        try:
            save_checkpoint(Path(root) / "mid_forward", step=0, model=model, optimizer=optimizer)
        except Exception as err:
            caught["error"] = f"{type(err).__name__}: {err}"

    model.module[0].register_forward_hook(save_now)
    model(torch.ones(2, 3)).sum().backward()
    return {"error": caught.get("error"), "exists": (Path(root) / "mid_forward").exists()}


def test_a_checkpoint_inside_forward_is_refused_on_every_rank(tmp_path: Path) -> None:
    for rank, result in enumerate(run_distributed(_save_in_forward, 2, str(tmp_path), timeout_s=120)):
        assert result["error"] is not None and "between training steps" in result["error"], f"rank {rank}"
        assert "FORWARD" in result["error"] and not result["exists"]


def _per_rank_unit(rank: int, world_size: int, root: str) -> dict[str, Any]:
    own = [dist.new_group([r]) for r in range(world_size)][rank]  # every rank creates every group, in order
    model = FSDP(nn.Sequential(FSDP(nn.Linear(3, 3), process_group=own), nn.Tanh(), nn.Linear(3, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.full((2, 3), float(rank))).sum().backward()  # the inner unit's values now differ per rank
    optimizer.step()
    try:
        save_checkpoint(Path(root) / "per_rank", step=0, model=model, optimizer=optimizer)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}", "exists": (Path(root) / "per_rank").exists()}
    return {"error": None, "exists": True}


def test_a_unit_sharded_over_part_of_the_job_is_refused_on_every_rank(tmp_path: Path) -> None:
    for rank, result in enumerate(run_distributed(_per_rank_unit, 2, str(tmp_path), timeout_s=120)):
        assert result["error"] is not None and "sharded over 1 ranks with 1 replica" in result["error"], rank
        assert "HYBRID_SHARD" in result["error"] and not result["exists"]


class StagedTiedNet(TiedNet):
    """:class:`TiedNet` with the embedding on pipeline stage 0 and the rest (the tied head) on stage 1."""

    def __init__(self, seed: int) -> None:
        import shardkit.modelparallel as smp

        nn.Module.__init__(self)
        torch.manual_seed(seed)
        self.emb = nn.Embedding(10, 4)
        with smp.partition(1):
            self.mid = nn.Linear(4, 4)
            self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def _smp_ties(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import shardkit.modelparallel as smp

    smp.init({"partitions": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0})
    net = StagedTiedNet(seed=0)
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    @smp.step
    def step(model: Any, tokens: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(tokens).reshape(-1, 10), tokens.reshape(-1))
        model.backward(loss)
        return loss

    step(model, torch.arange(8).reshape(4, 2))
    optimizer.step()
    stages = model.holding_stages("emb.weight")
    replicas = [
        (h.replica_rank, h.replica_count) for h in SMPSource(model, optimizer).held() if h.spans[0].fqn == "emb.weight"
    ]
    save_checkpoint(Path(root) / "smp", step=0, model=model, optimizer=optimizer)
    gathered = {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}
    smp.reset()
    plain = TiedNet(seed=1)
    load_checkpoint(Path(root) / "smp", model=plain, optimizer=torch.optim.SGD(plain.parameters(), lr=0.1))
    return {
        "stages": stages,
        "replicas": replicas,
        "smp": gathered,
        "plain": _values(plain),
        "tied": plain.head.weight is plain.emb.weight,
    }


def test_smp_weights_tied_across_stages_are_written_once_and_load_tied(tmp_path: Path) -> None:
    for rank, result in enumerate(run_distributed(_smp_ties, 2, str(tmp_path), timeout_s=120)):
        assert result["stages"] == (0, 1), f"rank {rank}: the tied weight should live on both stages"
        assert result["replicas"] == [(rank, 2)], "each stage writes half of the tied weight"
        assert result["tied"] and set(result["plain"]) == set(result["smp"])
        for key, value in result["smp"].items():
            assert torch.equal(torch.from_numpy(value), torch.from_numpy(result["plain"][key])), key


def _smp_cold_load(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from any_to_any_lib import build, release, train

    source = build("plain", rank, world_size, seed=0)  # the same plain model and batches on both ranks
    train(source, range(2))
    save_checkpoint(Path(root) / "plain", step=1, model=source.model, optimizer=source.optimizer)
    run = build("smp", rank, world_size, seed=1)
    load_checkpoint(Path(root) / "plain", model=run.model, optimizer=run.optimizer)  # before the partition
    train(run, range(2, 3))
    inner = run.optimizer.optimizer
    held = {id(p) for p in run.model.local_parameters()}
    with_state = {id(p) for p in inner.state}
    release(run)
    return {"held": len(held), "with_state": len(with_state), "only_held": with_state <= held}


def test_smp_loaded_before_the_partition_keeps_only_its_stages_optimizer_state(tmp_path: Path) -> None:
    for rank, result in enumerate(run_distributed(_smp_cold_load, 2, str(tmp_path), timeout_s=120)):
        assert result["only_held"] and result["with_state"] == result["held"] > 0, f"rank {rank}: {result}"
