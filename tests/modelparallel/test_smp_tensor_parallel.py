"""smp with ``tensor_parallel_degree`` > 1 (issue 34): the rank layout of every ``placement_strategy`` against the
tables of smp's docs, smp's validity rules refused on every rank, the marking and registration API, and training
with ``smp.nn.DistributedLinear`` at TP 2 x reduced data 2 equal to plain torch on the whole batch."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from smp_testlib import split_linears_run
from torch import nn

import shardkit.modelparallel as smp
from shardkit.modelparallel import state as smp_state
from shardkit.modelparallel.topology import Topology
from shardkit.modelparallel.tp.distribute import distribute, distribute_marked
from shardkit.tensor_parallel import gather_from_tp
from shardkit.testing import run_distributed


def _table(placement: str) -> list[tuple[int, int, int]]:
    return [(t.rdp_rank, t.mp_rank, t.tp_rank) for t in (Topology(8, r, 2, placement, 2) for r in range(8))]


def test_placement_strategies_lay_ranks_out_as_smps_tables() -> None:
    # smp's "Placement Strategy with Tensor Parallelism" tables: (rdp_rank, pp_rank, tp_rank) of ranks 0..7.
    dpt = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    ptd = [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1), (0, 1, 0), (1, 1, 0), (0, 1, 1), (1, 1, 1)]
    assert _table("DPT") == _table("cluster") == dpt
    assert _table("PTD") == ptd
    assert _table("spread") == _table("TPD") == [(r % 2, r // 2 % 2, r // 4) for r in range(8)]
    topo = Topology(8, 5, 2, "DPT", 2)
    assert (topo.dp_size, topo.rdp_size, topo.dp_rank, topo.smp_mp_rank) == (4, 2, 3, 1)
    assert topo.dp_group_ranks(0) == [0, 1, 4, 5] and topo.smp_mp_group_ranks() == [4, 5, 6, 7]
    assert topo.group_ranks("tensor") == [4, 5] and topo.group_ranks("data") == [1, 5]
    with pytest.raises(ValueError, match=r"multiple of pipeline_parallel_degree \(2\) x tensor_parallel_degree \(4\)"):
        Topology(12, 0, 2, "cluster", 4)


def test_config_rules_are_checked_before_anything_is_built() -> None:
    smp.reset()
    with pytest.raises(ValueError, match="tensor_parallel_degree=2 needs 'ddp': True"):
        smp.init({"tensor_parallel_degree": 2})
    with pytest.raises(ValueError, match="partitions=1 x tensor_parallel_degree=2 needs 2 processes"):
        smp.init({"tensor_parallel_degree": 2, "ddp": True})
    with pytest.raises(ValueError, match="placement_strategy"):
        smp.init({"placement_strategy": "DPP"})
    assert smp.ModelParallelConfig.from_dict({"placement_strategy": "ptd"}).placement_order == "PTD"
    assert not smp.is_initialized()


class Block(nn.Module):
    """A user module registered below with a distributed version and all three hooks."""

    def __init__(self, width: int, scale: float = 1.0) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale


class DistributedBlock(smp.nn.DistributedModule):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.inner = smp.nn.DistributedLinear(in_features, out_features)

    def forward(self, pair: tuple[torch.Tensor, float]) -> dict[str, torch.Tensor]:
        return {"out": self.inner(pair[0]) * pair[1]}


smp.tp_register_with_module(
    Block,
    DistributedBlock,
    init_hook=lambda width, scale=1.0: ((width, width), {}),
    forward_hook=lambda x: (((x, 2.0),), {}),
    return_hook=lambda out: out["out"],
)


def _marked_model() -> nn.Sequential:
    with smp.tensor_parallelism():
        first = nn.Linear(4, 8)
        with smp.tensor_parallelism(enabled=False):
            kept = nn.Linear(8, 8)
        norm = nn.LayerNorm(8)
        block = Block(8)
    tied = nn.Linear(8, 8)
    with smp.tensor_parallelism():
        shares = nn.Linear(8, 8)
    shares.weight = tied.weight
    late = nn.Linear(8, 8)
    return nn.Sequential(first, kept, norm, block, tied, shares, late)


def test_marks_registrations_and_the_one_log_of_unsplit_modules(caplog: pytest.LogCaptureFixture) -> None:
    smp.reset()
    smp.init({})
    try:
        model = _marked_model()
        smp.set_tensor_parallelism(model[6], True)
        reference = [m.weight.detach().clone() for m in (model[0], model[6])]
        with caplog.at_level(logging.WARNING, logger="shardkit.modelparallel"):
            done = distribute_marked(model, smp_state.current())
        assert done.replaced == ["0", "3", "6"]
        assert [type(m).__name__ for m in model] == [
            "DistributedLinear", "Linear", "LayerNorm", "DistributedBlock", "Linear", "Linear", "DistributedLinear"
        ]  # fmt: skip
        assert [name for name, _ in done.unsplit] == ["2", "5"], done.unsplit
        assert "no distributed version registered for LayerNorm" in done.unsplit[0][1]
        assert "shares a weight" in done.unsplit[1][1]
        assert [r.getMessage() for r in caplog.records] == [done.report()]
        assert torch.equal(model[0].weight, reference[0]) and torch.equal(model[6].weight, reference[1])
        x = torch.randn(2, 4)
        block_in = model[2](model[1](model[0](x)))
        expected = F.linear(block_in, model[3].inner.weight, model[3].inner.bias) * 2.0  # the hooks' scale 2
        assert torch.allclose(model[3](block_in), expected)
        smp.set_tensor_parallelism(model, False)
        assert distribute(nn.Sequential(model[1])).replaced == []
    finally:
        smp.reset()


def _distribute_and_train(rank: int, world_size: int) -> dict[str, Any]:
    """On TP 2 x reduced data 2 ("spread" = "TPD": tensor slowest): the helpers, the marking, and three SGD steps
    of a model with split and replicated parameters, with and without prescaled_batch, against plain torch."""
    out: dict[str, Any] = {}
    for prescaled in (False, True):
        smp.init(
            {"tensor_parallel_degree": 2, "ddp": True, "placement_strategy": "spread", "prescaled_batch": prescaled}
        )
        try:
            if not prescaled:
                out["helpers"] = _helpers()
                total = torch.tensor([float(rank)])
                dist.all_reduce(total, group=smp.get_tp_process_group())
                out["tp_sum"] = total.item()
            out[prescaled] = _train_against_torch(prescaled)
        finally:
            smp.reset()
        smp.init(
            {"tensor_parallel_degree": 2, "ddp": True, "placement_strategy": "spread", "prescaled_batch": prescaled}
        )
        try:
            out["transformer", prescaled] = _train_transformer(prescaled)
        finally:
            smp.reset()
    return out


def _helpers() -> dict[str, Any]:
    names = ["rank", "tp_rank", "tp_size", "rdp_rank", "rdp_size", "dp_rank", "dp_size", "mp_rank", "mp_size"]
    got: dict[str, Any] = {name: getattr(smp, name)() for name in names}
    for name in ["get_tp_group", "get_rdp_group", "get_dp_group", "get_mp_group", "get_pp_group"]:
        got[name] = getattr(smp, name)()
    got["TP_GROUP"] = smp.allgather(smp.rank(), smp.TP_GROUP)
    got["RDP_GROUP"] = smp.allgather(smp.rank(), smp.RDP_GROUP)
    return got


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 4))


class ReferenceAttention(nn.Module):
    """smp's reference AttentionLayer (its docs' appendix), with pre and post layer norms and a causal mask."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value, self.dense = (nn.Linear(hidden, hidden) for _ in range(4))
        self.pre_layernorm, self.layernorm = nn.LayerNorm(hidden), nn.LayerNorm(hidden)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.pre_layernorm(hidden_states)
        n, length, width = x.shape
        q, k, v = (lin(x).view(n, length, self.heads, -1).transpose(1, 2) for lin in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / (width // self.heads) ** 0.5
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), torch.finfo(scores.dtype).min)
        context = (F.softmax(scores + mask, dim=-1) @ v).transpose(1, 2).reshape(n, length, width)
        return self.layernorm(self.dense(context) + hidden_states)


class ReferenceOutput(nn.Module):
    """smp's reference TransformerOutputLayer, with pre and post layer norms and GELU."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.dense1, self.dense2 = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)
        self.pre_layernorm, self.layernorm = nn.LayerNorm(hidden), nn.LayerNorm(hidden)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return self.layernorm(inp + self.dense2(F.gelu(self.dense1(self.pre_layernorm(inp)))))


class TransformerNet(nn.Module):
    """An input projection (nn.Linear, marked), two transformer layers (smp.nn's, or the reference's) and a head."""

    def __init__(self, distributed: bool) -> None:
        super().__init__()
        with smp.tensor_parallelism(enabled=distributed):
            self.embed = nn.Linear(8, 16)
        self.layers: nn.Module
        if distributed:
            self.layers = smp.nn.DistributedTransformer(
                num_layers=2, num_attention_heads=4, attention_head_size=4, hidden_size=16, intermediate_size=32,
                attention_dropout_prob=0.0, hidden_dropout_prob=0.0, causal_mask_size=6, pre_layernorm=True,
            )  # fmt: skip
        else:
            self.layers = nn.ModuleList(
                m for _ in range(2) for m in (ReferenceAttention(16, 4), ReferenceOutput(16, 32))
            )
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if isinstance(self.layers, nn.ModuleList):
            for attention, output in zip(self.layers[::2], self.layers[1::2]):
                h = output(attention(h, mask))
        else:
            h, _ = self.layers((h, mask))
        return self.head(h)


#: The dimension each split parameter of TransformerNet is split along (the others are whole on every rank).
_SPLIT_DIM = {"query": 0, "key": 0, "value": 0, "dense1": 0, "dense": 1, "dense2": 1, "embed": 1}


def _full_state(net: nn.Module) -> dict[str, torch.Tensor]:
    """TransformerNet's parameters gathered from the tensor-parallel ranks, under the reference's names."""
    renamed = {}
    for name, value in _gathered(net).items():  # seq_layers.<i>.attention.x -> layers.<2i>.x, .output.x -> <2i+1>
        parts = name.split(".")
        if parts[0] == "layers":
            index = 2 * int(parts[2]) + (parts[3] == "output")
            name = ".".join(["layers", str(index), *parts[4:]])
        renamed[name] = value
    return renamed


def _gathered(net: nn.Module) -> dict[str, torch.Tensor]:
    """TransformerNet's parameters gathered from the tensor-parallel ranks, under its own names."""
    group, full = smp.get_tp_process_group(), {}
    for name, p in net.named_parameters():
        parts = name.split(".")
        dim = _SPLIT_DIM.get(parts[-2], -1)
        if (parts[-1] == "bias" and dim == 1) or dim == -1:
            full[name] = p.detach()
        else:
            full[name] = gather_from_tp(p.detach(), group, dim=dim)
    return full


def _train_transformer(prescaled: bool) -> dict[str, Any]:
    torch.manual_seed(1)
    reference = TransformerNet(distributed=False)
    torch.manual_seed(1)
    model = smp.DistributedModel(TransformerNet(distributed=True))
    assert isinstance(model.module.embed, smp.nn.DistributedLinear)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2))
    plain = torch.optim.SGD(reference.parameters(), lr=0.2)
    parts, index = (smp.rdp_size(), smp.rdp_rank()) if prescaled else (smp.dp_size(), smp.dp_rank())

    @smp.step
    def train(model: smp.DistributedModel, x: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x, mask), y)
        model.backward(loss)
        return loss

    losses, theirs = [], []
    for step in range(2):
        gen = torch.Generator().manual_seed(10 + step)
        x, y = torch.randn(8, 6, 8, generator=gen), torch.randn(8, 6, 4, generator=gen)
        mask = torch.where(torch.rand(8, 1, 1, 6, generator=gen) < 0.2, -1e4, 0.0)
        optimizer.zero_grad()
        shard = [t.chunk(parts)[index] for t in (x, mask, y)]
        losses.append(smp.allgather(train(model, *shard).reduce_mean().item(), smp.DP_GROUP))
        norm = optimizer.clip_master_grads(0.5).item()
        optimizer.step()
        plain.zero_grad()
        ref_loss = F.mse_loss(reference(x, mask), y)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5).item()
        assert abs(norm - ref_norm) < 1e-5 * max(1.0, ref_norm), (step, norm, ref_norm)
        plain.step()
        theirs.append(ref_loss.item())
    mine = _full_state(model.module)
    errors = {name: (mine[name] - p.detach()).abs().max().item() for name, p in reference.named_parameters()}
    # A full state dict merges the slices (what a full checkpoint holds); loading it back cuts them again.
    merged, local = model.state_dict(), {n: p.detach().clone() for n, p in model.module.named_parameters()}
    merge_ok = all(torch.equal(merged[n], t) for n, t in _gathered(model.module).items())
    model.load_state_dict(merged)
    cut_ok = all(torch.equal(p, local[n]) for n, p in model.module.named_parameters())
    return {"losses": losses, "theirs": theirs, "errors": errors, "merge_and_cut": (merge_ok, cut_ok)}


def _train_against_torch(prescaled: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = _net()
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        net = _net()
    model = smp.DistributedModel(net)
    replaced = [type(m).__name__ for m in net]
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.3))
    plain = torch.optim.SGD(reference.parameters(), lr=0.3)
    # Each rank trains on its own quarter of the batch, or (prescaled) its tensor-parallel group's half.
    parts, index = (smp.rdp_size(), smp.rdp_rank()) if prescaled else (smp.dp_size(), smp.dp_rank())

    @smp.step
    def train(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    losses, theirs = [], []
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        optimizer.zero_grad()
        loss = train(model, x.chunk(parts)[index], y.chunk(parts)[index]).reduce_mean()
        norms = [optimizer.clip_master_grads(0.5).item()]  # clips: the weights below check the clipping too
        optimizer.step()
        losses.append(smp.allgather(loss.item(), smp.DP_GROUP))
        plain.zero_grad()
        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5).item())
        plain.step()
        theirs.append(ref_loss.item())
        assert abs(norms[0] - norms[1]) < 1e-5 * max(1.0, norms[1]), (step, norms)
    group = smp.get_tp_process_group()
    full = {
        "0.weight": gather_from_tp(net[0].weight.detach(), group, dim=1),
        "3.weight": gather_from_tp(net[3].weight.detach(), group, dim=1),
    }
    errors = {
        name: (full.get(name, p.detach()) - p.detach()).abs().max().item() for name, p in reference.state_dict().items()
    }
    return {"replaced": replaced, "losses": losses, "theirs": theirs, "errors": errors}


def test_tp2_x_rdp2_helpers_and_training_equal_plain_torch() -> None:
    results = run_distributed(_distribute_and_train, 4)
    for rank, result in enumerate(results):
        tp, rdp = rank // 2, rank % 2  # "spread" = "TPD": tensor slowest, reduced data fastest
        helpers = result["helpers"]
        assert (helpers["tp_rank"], helpers["tp_size"], helpers["rdp_rank"], helpers["rdp_size"]) == (tp, 2, rdp, 2)
        assert (helpers["dp_rank"], helpers["dp_size"], helpers["mp_rank"], helpers["mp_size"]) == (
            rdp * 2 + tp,
            4,
            tp,
            2,
        )
        assert helpers["get_tp_group"] == helpers["TP_GROUP"] == [rdp, rdp + 2]
        assert helpers["get_rdp_group"] == helpers["RDP_GROUP"] == [tp * 2, tp * 2 + 1]
        assert helpers["get_dp_group"] == [0, 2, 1, 3] and helpers["get_mp_group"] == [rdp, rdp + 2]
        assert helpers["get_pp_group"] == [rank] and result["tp_sum"] == 2 * rdp + 2
        for prescaled in (False, True):
            run = result[prescaled]
            assert run["replaced"] == ["DistributedLinear", "LayerNorm", "Tanh", "DistributedLinear"], run
            for ranks_losses, theirs in zip(run["losses"], run["theirs"]):
                assert abs(sum(ranks_losses) / len(ranks_losses) - theirs) < 1e-5, (prescaled, run)
            assert max(run["errors"].values()) < 1e-5, (prescaled, run["errors"])
            run = result["transformer", prescaled]
            for ranks_losses, theirs in zip(run["losses"], run["theirs"]):
                assert abs(sum(ranks_losses) / len(ranks_losses) - theirs) < 1e-5, (prescaled, run)
            assert max(run["errors"].values()) < 2e-5, (prescaled, run["errors"])
            assert run["merge_and_cut"] == (True, True), run


def _refusals(rank: int, world_size: int) -> list[str]:
    messages = []
    for config in ({"tensor_parallel_degree": 4, "ddp": True}, {"tensor_parallel_degree": 2}):
        try:
            smp.init(config)
            messages.append("accepted")
        except ValueError as exc:
            messages.append(str(exc))
        finally:
            smp.reset()
    smp.init({"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": True})
    try:
        smp.nn.DistributedLinear(4, 4)(torch.full((2, 4), float(rank)))  # a batch per rank, where one is promised
    except ValueError as exc:
        messages.append(str(exc))
    finally:
        smp.reset()
    return messages


def test_invalid_layouts_and_inputs_are_refused_on_every_rank() -> None:
    for too_big, no_ddp, different in run_distributed(_refusals, 2):
        assert "world size (2) to be a multiple of pipeline_parallel_degree (1) x tensor_parallel_degree (4)" in too_big
        assert "needs 'ddp': True" in no_ddp
        assert "got different inputs" in different and "shard the data by smp.rdp_rank()" in different


def _pipeline_and_tensor(rank: int, world_size: int) -> dict[str, Any]:
    """TP 2 x pipeline 2 ("cluster" = "DPT"): two micro-batches through two stages of split layers."""
    smp.init({"tensor_parallel_degree": 2, "partitions": 2, "microbatches": 2, "ddp": True})
    try:
        run = split_linears_run(torch.optim.SGD, 0.3, shard_by_rdp=False)
        return {"pp_rank": smp.pp_rank(), "tp_rank": smp.tp_rank(), **run}
    finally:
        smp.reset()


def test_tp2_x_pipeline2_trains_equal_to_plain_torch() -> None:
    results = run_distributed(_pipeline_and_tensor, 4)
    assert [(r["pp_rank"], r["tp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for result in results:
        for ranks_losses, theirs in zip(result["losses"], result["theirs"]):
            assert abs(sum(ranks_losses) / len(ranks_losses) - theirs) < 1e-5, result
