"""Tensor-parallel checkpoints: saved without gathering, loaded at any other degree, with or without tensor
parallelism, optimizer state included (the any-to-any matrix's tensor-parallel rows).

One job of four processes holds every configuration at once: the plain model (every rank whole), torch DDP and
shardkit FSDP (nested units) over all four (TP 1 x data 4), TP 2 (the two data halves hold the same model), TP 2 x
DDP 2, TP 2 x shardkit FSDP 2 and TP 2 x OSS 2 (under DDP) over the data group, and TP 4 (saved asynchronously).
Each starts from a reference model's initial weights split for its degree, trains the reference's first Adam step
and saves. Every configuration loads every checkpoint into a fresh model (half of them after a step of their own, so
the optimizer state is read in place), must then hold the reference's weights and Adam state split for its degree,
and trains on to match the reference's second step. The toy model has a vocabulary-parallel embedding (split along
dimension 0), a row-parallel weight (dimension 1, the split that is not a flat span), a fused QKV split with stride
3, and replicated norms.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from shardkit import tensor_parallel as tp
from shardkit.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from shardkit.checkpoint.api import save_source
from shardkit.checkpoint.tools.export import export_safetensors
from shardkit.checkpoint.tools.inspect import format_report, inspect_checkpoint
from shardkit.checkpoint.tools.write import StaticSource
from shardkit.checkpoint.universal.source import Held, Span
from shardkit.checkpoint.universal.split import Split
from shardkit.nn import FullyShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing import run_distributed

VOCAB, HIDDEN, FF = 16, 8, 16
LR = 0.01


class Toy(nn.Module):
    """Embedding, a feed-forward pair, a fused-QKV gate and a head; torch layers when ``mesh`` is None."""

    def __init__(self, mesh: Any) -> None:
        super().__init__()
        if mesh is None:
            self.emb: nn.Module = nn.Embedding(VOCAB, HIDDEN)
            self.up: nn.Module = nn.Linear(HIDDEN, FF)
            self.down: nn.Module = nn.Linear(FF, HIDDEN)
            self.qkv: nn.Module = nn.Linear(HIDDEN, 3 * HIDDEN)
            self.out: nn.Module = nn.Linear(HIDDEN, HIDDEN)
            self.head: nn.Module = nn.Linear(HIDDEN, VOCAB, bias=False)
        else:
            self.emb = tp.VocabParallelEmbedding(VOCAB, HIDDEN, mesh=mesh)
            self.up = tp.ColumnParallelLinear(HIDDEN, FF, gather_output=False, mesh=mesh)
            self.down = tp.RowParallelLinear(FF, HIDDEN, input_is_parallel=True, mesh=mesh)
            self.qkv = tp.ColumnParallelLinear(HIDDEN, 3 * HIDDEN, gather_output=False, stride=3, mesh=mesh)
            self.out = tp.RowParallelLinear(HIDDEN, HIDDEN, input_is_parallel=True, mesh=mesh)
            self.head = tp.ColumnParallelLinear(HIDDEN, VOCAB, bias=False, gather_output=True, mesh=mesh)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + self.down(torch.tanh(self.up(h)))
        q, k, v = self.qkv(h).chunk(3, dim=-1)  # with stride 3 each rank holds its heads of q, k and v
        h = self.norm(h + self.out(torch.tanh(q * k) * v))
        out: torch.Tensor = self.head(h)
        return out


class Config(NamedTuple):
    name: str
    degree: int  # 0: torch layers (no tensor parallelism)
    #: "ddp", "fsdp", or "oss" (OSS under DDP) over the data group (all ranks without tensor parallelism)
    wrap: str = ""


CONFIGS = [
    Config("plain", 0),
    Config("ddp4", 0, "ddp"),
    Config("fsdp4", 0, "fsdp"),
    Config("tp2", 2),
    Config("tp2xddp2", 2, "ddp"),
    Config("tp2xfsdp2", 2, "fsdp"),
    Config("tp2xoss2", 2, "oss"),
    Config("tp4", 4),
]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (2, 5), generator=g), torch.randint(0, VOCAB, (2, 5), generator=g)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    tokens, targets = _batch(step)
    optimizer.zero_grad()
    F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1)).backward()
    optimizer.step()


def _reference() -> dict[Any, Any]:
    """The unsplit model's initial weights, and its weights and optimizer state after one and two Adam steps."""
    torch.manual_seed(0)
    model = Toy(None)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    out: dict[Any, Any] = {"init": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    for step in (0, 1):
        _step(model, optimizer, step)
        names = {id(p): n for n, p in model.named_parameters()}
        out[step] = {
            "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()},
        }
    return out


class Run(NamedTuple):
    config: Config
    model: nn.Module
    inner: Toy
    optimizer: torch.optim.Optimizer
    state: Optional[tp.ParallelState]
    #: How the model's parameters are split (by the unwrapped model's names).
    specs: dict[str, tp.ShardSpec]

    def split(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the reference tensor ``full`` of parameter ``name``."""
        spec = self.specs.get(name)
        if spec is None or self.state is None:
            return full
        return spec.shard(full, self.state.tp_rank, self.state.tp_size)

    def model_state(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers (its tensor-parallel slabs, FSDP's gathered)."""
        return dict((self.model if self.config.wrap == "fsdp" else self.inner).state_dict())


def _build(config: Config, states: dict[int, tp.ParallelState], seed: int, init: Optional[dict[str, Any]]) -> Run:
    """The model of ``config`` from ``seed``, or with the reference's initial weights ``init`` split for it."""
    torch.manual_seed(seed)
    state = states.get(config.degree)
    inner = Toy(None if state is None else state.tp_mesh)
    run = Run(config, inner, inner, torch.optim.SGD([torch.zeros(1)]), state, tp.tp_sharding(inner))
    if init is not None:
        inner.load_state_dict({k: run.split(k, v) for k, v in init.items()})
    group = None if state is None else state.group("data")
    model: nn.Module = inner
    if config.wrap in ("ddp", "oss"):
        model = DistributedDataParallel(inner, process_group=group)
    elif config.wrap == "fsdp":  # nested: the feed-forward pair and the QKV layer are units of their own
        for unit in ("up", "down", "qkv"):
            setattr(inner, unit, FullyShardedDataParallel(getattr(inner, unit), process_group=group))
        model = FullyShardedDataParallel(inner, process_group=group)
    if config.wrap == "oss":
        return run._replace(model=model, optimizer=OSS(model.parameters(), torch.optim.Adam, group=group, lr=LR))
    return run._replace(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=LR))


def _mismatch(run: Run, ref: dict[str, Any]) -> Optional[str]:
    """Where this rank's model or optimizer state differs from the reference split for its degree."""
    for name, value in run.model_state().items():
        if not torch.allclose(value, run.split(name, ref["model"][name]), rtol=1e-5, atol=1e-6):
            return f"parameter {name}"
    if run.config.wrap in ("fsdp", "oss"):
        return None  # the optimizer state is sharded over the data group: the step after loading checks it
    for name, param in run.inner.named_parameters():
        for key, want in ref["optim"][name].items():
            have = run.optimizer.state[param][key]
            if not torch.allclose(have, want if want.dim() == 0 else run.split(name, want), rtol=1e-5, atol=1e-6):
                return f"optimizer state {key} of {name}"
    return None


def _trained_gap(run: Run, ref: dict[str, Any]) -> float:
    """Largest difference to the reference's weights after its second step, this rank's slabs gathered."""
    gap = 0.0
    for name, local in run.model_state().items():
        full = local
        spec = run.specs.get(name)
        if spec is not None and run.state is not None:
            parts = [torch.empty_like(local) for _ in range(run.state.tp_size)]
            dist.all_gather(parts, local.contiguous(), group=run.state.tp_group)
            full = spec.unshard(parts)
        gap = max(gap, (full - ref["model"][name]).abs().max().item())
    return gap


def _matrix(rank: int, world_size: int, root: str) -> dict[str, Any]:
    states = {d: tp.build_parallel_state(tp.ParallelLayout.for_world(world_size, tensor=d)) for d in (2, 4)}
    incomplete = _load_incomplete(states, str(Path(root) / "incomplete"))
    dtensor = _save_dtensor_model(states[2], str(Path(root) / "dtensor"))
    not_dividing = _load_at_a_degree_that_does_not_divide(states, str(Path(root) / "vocab18"))
    ref = _reference()
    for config in CONFIGS:  # each trains the reference's first step at its degree, and saves
        run = _build(config, states, seed=0, init=ref["init"])
        _step(run.model, run.optimizer, 0)
        # TP 4 saves asynchronously: its slabs (strided views for dimension 1) are staged in host memory first
        asynchronous = config.name == "tp4"
        save_checkpoint(
            Path(root) / config.name, step=0, model=run.model, optimizer=run.optimizer, async_save=asynchronous
        )
    results: dict[str, Any] = {}
    for i, source in enumerate(CONFIGS):
        for j, target in enumerate(CONFIGS):
            run = _build(target, states, seed=7, init=None)
            warm = (i + j) % 2 == 1
            if warm:  # the optimizer already holds state: the load reads into it
                _step(run.model, run.optimizer, 5)
            load_checkpoint(Path(root) / source.name, model=run.model, optimizer=run.optimizer)
            loaded = _mismatch(run, ref[0])
            _step(run.model, run.optimizer, 1)
            results[f"{source.name}->{target.name}"] = (loaded, _trained_gap(run, ref[1]), warm)
    return {"matrix": results, "incomplete": incomplete, "dtensor": dtensor, "not_dividing": not_dividing}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("tp_any_to_any")
    _save_incomplete(root / "incomplete")
    per_rank = run_distributed(_matrix, 4, str(root), timeout_s=240)
    reports = {c.name: inspect_checkpoint(root / c.name) for c in CONFIGS}
    [exported] = export_safetensors(root / "tp4", root / "tp4.safetensors")
    return {"per_rank": per_rank, "reports": reports, "exported": load_file(str(exported))}


@pytest.mark.parametrize("source", [c.name for c in CONFIGS])
@pytest.mark.parametrize("target", [c.name for c in CONFIGS])
def test_tp_checkpoint_loads_at_every_degree_and_training_continues(
    matrix: dict[str, Any], source: str, target: str
) -> None:
    for rank, results in enumerate(matrix["per_rank"]):
        loaded, gap, warm = results["matrix"][f"{source}->{target}"]
        assert loaded is None, f"rank {rank} (warm={warm}): {loaded} differs right after loading"
        assert gap < 1e-5, f"rank {rank}: after one more step the weights differ from the reference by {gap}"


def test_a_tp_checkpoint_exports_as_the_unsplit_model(matrix: dict[str, Any]) -> None:
    want = _reference()[0]["model"]
    assert set(matrix["exported"]) == set(want)
    for name, value in want.items():
        assert torch.allclose(matrix["exported"][name], value, rtol=1e-5, atol=1e-6), name


def test_inspect_shows_the_tp_layout(matrix: dict[str, Any]) -> None:
    reports = matrix["reports"]
    assert reports["plain"]["tensor_parallel"] is None and reports["ddp4"]["tensor_parallel"] is None
    layout = reports["tp2xddp2"]["tensor_parallel"]
    assert layout["degree"] == 2 and set(layout["parameters"]) == set(SPECS)
    assert layout["parameters"]["down.weight"] == {"shape": [HIDDEN, FF], "dim": 1, "size": 2, "stride": 1}
    assert layout["parameters"]["qkv.weight"] == {"shape": [3 * HIDDEN, HIDDEN], "dim": 0, "size": 2, "stride": 3}
    assert reports["tp4"]["tensor_parallel"]["degree"] == 4
    text = format_report(reports["tp4"])
    assert "tensor parallel: saved at degree 4" in text
    assert f"down.weight ({HIDDEN}x{FF}): dimension 1 across 4 ranks" in text
    assert f"qkv.weight ({3 * HIDDEN}x{HIDDEN}): dimension 0 across 4 ranks, stride 3" in text
    # each rank's slab of a split weight is its own DCP chunk of the full-shaped tensor: nothing was gathered
    chunks = {t["key"]: t["chunks"] for t in reports["tp4"]["tensors"]}
    assert chunks["model/down.weight"] == 4 and chunks["model/qkv.weight"] == 12
    assert chunks["optim/down.weight/exp_avg"] == 4


def _load_incomplete(states: dict[int, tp.ParallelState], directory: str) -> list[str]:
    """Load the incomplete shard set into TP 2, TP 4 and the plain model: each error, and whether it changed nothing."""
    errors = []
    for target in (Config("tp2", 2), Config("tp4", 4), Config("plain", 0)):
        fresh = _build(target, states, seed=3, init=None)
        assert target.degree == 0 or fresh.specs == SPECS
        before = {k: v.clone() for k, v in fresh.inner.state_dict().items()}
        try:
            load_checkpoint(directory, model=fresh.model)
        except CheckpointError as err:
            unchanged = all(torch.equal(before[k], v) for k, v in fresh.inner.state_dict().items())
            errors.append(f"{unchanged}: {err}")
        else:
            errors.append("loaded")
    return errors


#: How the toy model's tensor-parallel layers split their parameters.
SPECS = {
    "emb.weight": tp.ShardSpec(0),
    "up.weight": tp.ShardSpec(0),
    "up.bias": tp.ShardSpec(0),
    "down.weight": tp.ShardSpec(1),
    "qkv.weight": tp.ShardSpec(0, 3),
    "qkv.bias": tp.ShardSpec(0, 3),
    "out.weight": tp.ShardSpec(1),
    "head.weight": tp.ShardSpec(0),
}


def _load_at_a_degree_that_does_not_divide(states: dict[int, tp.ParallelState], directory: str) -> str:
    """A vocabulary of 18 saved at TP 2 (9 rows each), loaded at TP 4 into a model padded to 20 rows: the error."""
    saved = nn.ModuleDict({"emb": tp.VocabParallelEmbedding(18, HIDDEN, mesh=states[2].tp_mesh)})
    save_checkpoint(directory, step=0, model=saved)
    target = nn.ModuleDict({"emb": tp.VocabParallelEmbedding(20, HIDDEN, mesh=states[4].tp_mesh)})
    before = target.emb.weight.detach().clone()
    try:
        load_checkpoint(directory, model=target)
    except CheckpointError as err:
        return f"{torch.equal(before, target.emb.weight)}: {err}"
    return "loaded"


def test_a_tp_checkpoint_whose_sizes_do_not_split_at_the_new_degree_is_refused_naming_them(
    matrix: dict[str, Any],
) -> None:
    for rank, results in enumerate(matrix["per_rank"]):
        message = results["not_dividing"]
        assert message.startswith("True: "), f"rank {rank}: {message}"
        assert "'emb.weight'" in message and "size 18" in message and "4 tensor-parallel ranks" in message
        assert "[1, 2, 3, 6, 9, 18]" in message


def _save_dtensor_model(state: tp.ParallelState, directory: str) -> str:
    """Try to save a model whose parameters torch's ``parallelize_module`` made DTensors; the error, if any."""
    torch.manual_seed(0)
    model = Toy(None)
    parallelize_module(model.up, state.tp_mesh, ColwiseParallel())
    try:
        save_checkpoint(directory, step=0, model=model)
    except CheckpointError as err:
        return f"{Path(directory).exists()}: {err}"
    return "saved"


def test_a_model_with_dtensor_parameters_is_refused_before_anything_is_written(matrix: dict[str, Any]) -> None:
    for rank, results in enumerate(matrix["per_rank"]):
        message = results["dtensor"]
        assert message.startswith("False: "), f"rank {rank}: {message}"
        assert "'up.weight'" in message and "DTensor" in message and "torch.distributed.checkpoint" in message


def _save_incomplete(directory: Path) -> None:
    """A TP 2 shard set of which only tensor-parallel rank 0's slabs were written (saved by one process: with a
    process group, DCP itself refuses a plan that leaves part of a tensor unwritten)."""
    torch.manual_seed(0)
    held = []
    for name, full in Toy(None).state_dict().items():
        spec = SPECS.get(name)
        if spec is None:
            held.append(Held(full, (Span(name, full.shape, 0, full.numel()),)))
        else:
            slab = spec.shard(full, 0, 2)
            split = Split(spec.dim, 0, 2, spec.stride)
            held.append(Held(slab, (Span(name, full.shape, 0, slab.numel(), split=split),)))
    save_source(directory, StaticSource(held))


def test_an_incomplete_tp_shard_set_is_refused_on_every_rank_naming_the_parameter(matrix: dict[str, Any]) -> None:
    for rank, results in enumerate(matrix["per_rank"]):
        assert len(results["incomplete"]) == 3
        for message in results["incomplete"]:
            assert message.startswith("True: "), f"rank {rank}: {message}"
            assert "a shard is missing" in message and "'emb.weight'" in message, message
