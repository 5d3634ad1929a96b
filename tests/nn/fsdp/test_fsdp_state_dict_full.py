"""Full and local state dicts of FSDP: original keys and values, loading both ways, bad input, world sizes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardkit.distributed import DummyProcessGroup
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.nn.fsdp import state_dict as fsdp_sd
from shardkit.testing import models as M
from shardkit.testing import run_distributed

LR = 0.05


def build(name: str, group: Any = None, nested: bool = True, **kwargs: Any) -> FSDP:
    """Reference model ``name`` (seed 0) wrapped in FSDP; ``nested`` also wraps the inner pieces."""
    kw = {"process_group": group, **kwargs}
    wrap_fn = (lambda m: FSDP(m, **kw)) if nested else (lambda m: m)
    model = M.build(name, seed=0, **({"wrap_fn": wrap_fn} if name in ("nested", "batchnorm") else {}))
    if name == "lm" and nested:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = FSDP(block, **kw)
    return FSDP(model, **kw)


def train(name: str, model: nn.Module, steps: int, rank: int = 0, start: int = 0) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    target = model.module if isinstance(model, FSDP) else model
    for i in range(start, start + steps):
        x, y = M.make_batch(name, target, 4, seed=100 * i + rank)
        opt.zero_grad()
        M.loss_for(name, model(x), y).backward()
        opt.step()


def snapshot(model: FSDP) -> dict[str, torch.Tensor]:
    """Every shard and buffer, cloned."""
    return {k: v.clone() for k, v in model.local_state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert list(a) == list(b)
    for k in a:
        torch.testing.assert_close(
            a[k], b[k], atol=atol, rtol=0.0 if atol == 0 else 1e-5, msg=lambda m, k=k: f"{k}: {m}"
        )


DUMMY = DummyProcessGroup(rank=0, size=1)


@pytest.mark.parametrize("name", ["lm", "nested", "batchnorm"])
@pytest.mark.parametrize("flatten", [True, False])
def test_full_state_dict_equals_unwrapped_model(name: str, flatten: bool) -> None:
    ref = M.build(name, seed=0)
    model = build(name, DUMMY, flatten_parameters=flatten)
    train(name, ref, 2)
    train(name, model, 2)
    sd, want = model.state_dict(), ref.state_dict()
    assert list(sd) == list(want)  # same keys in the same order, tied weights under both names
    assert_same(sd, want, atol=1e-6)
    assert all(v.dtype == want[k].dtype for k, v in sd.items())
    assert sd._metadata == want._metadata


def test_full_state_dict_loads_into_unwrapped_model_and_back() -> None:
    model = build("lm", DUMMY)
    train("lm", model, 2)
    plain = M.build("lm", seed=1)
    plain.load_state_dict(model.state_dict())
    x, _ = M.lm_batch(plain.cfg, 2, seed=7)
    torch.testing.assert_close(plain(x), model(x), atol=0, rtol=0)
    # and back: a fresh wrapped model loads the unwrapped model's dict
    fresh = build("lm", DUMMY)
    result = fresh.load_state_dict(plain.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    torch.testing.assert_close(fresh(x), plain(x), atol=0, rtol=0)


def test_unwrapped_root_with_wrapped_children_saves_original_keys() -> None:
    # auto_wrap style: the root stays a plain module; torch's recursion reaches the wrapped blocks.
    ref = M.build("lm", seed=0)
    model = M.build("lm", seed=0)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = FSDP(block, process_group=DUMMY)
    sd = model.state_dict()
    assert list(sd) == list(ref.state_dict())
    assert_same(sd, ref.state_dict())


def test_mixed_precision_state_dict_is_fp32_with_original_buffer_dtypes() -> None:
    model = build("batchnorm", DUMMY, mixed_precision=True, compute_dtype=torch.bfloat16)
    train("batchnorm", model, 1)
    assert model.module.bn.running_mean.dtype == torch.bfloat16  # cast for compute ...
    sd = model.state_dict()
    ref = M.build("batchnorm", seed=0).state_dict()
    assert {k: v.dtype for k, v in sd.items()} == {k: v.dtype for k, v in ref.items()}  # ... saved as it was


@pytest.mark.parametrize(
    ("edit", "pattern"),
    [
        (lambda sd: sd.pop("blocks.1.fc2.bias"), r"missing keys \['blocks.1.fc2.bias'\]"),
        (lambda sd: sd.__setitem__("blocks.9.weight", torch.zeros(1)), r"unexpected keys \['blocks.9.weight'\]"),
        (lambda sd: sd.__setitem__("blocks.0.qkv.weight", torch.zeros(3, 3)), r"'blocks.0.qkv.weight' has shape"),
        (lambda sd: sd.__setitem__("ln_f.weight", torch.zeros(5)), r"'ln_f.weight' has shape \(5,\)"),
    ],
)
def test_bad_full_state_dict_names_the_key_and_changes_nothing(edit: Any, pattern: str) -> None:
    model = build("lm", DUMMY)
    sd = M.build("lm", seed=3).state_dict()
    edit(sd)
    before = snapshot(model)
    with pytest.raises(ValueError, match=pattern):
        model.load_state_dict(sd)
    assert_same(snapshot(model), before)


def test_non_strict_load_reports_keys_and_loads_the_rest() -> None:
    model = build("lm", DUMMY)
    donor = M.build("lm", seed=3)
    sd = donor.state_dict()
    sd.pop("ln_f.bias")
    sd["extra"] = torch.zeros(1)
    result = model.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["ln_f.bias"] and result.unexpected_keys == ["extra"]
    got = model.state_dict()
    torch.testing.assert_close(got["blocks.1.fc1.weight"], donor.blocks[1].fc1.weight.detach())
    torch.testing.assert_close(got["ln_f.bias"], M.build("lm", seed=0).ln_f.bias.detach())


def test_summon_full_params_uses_original_names() -> None:
    model = build("lm", DUMMY)
    with model.summon_full_params():
        names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in M.build("lm", seed=0).named_parameters()]


def test_local_state_dict_round_trip_single_process() -> None:
    model = build("batchnorm", DUMMY)
    saved = snapshot(model)
    local = model.local_state_dict()
    assert list(local) == [k for k in saved]
    assert "flat_param_0" in local and "body.flat_param_0" in local
    train("batchnorm", model, 1)
    model.load_local_state_dict({k: v for k, v in saved.items()})
    assert_same(snapshot(model), saved)


# ------------------------------------------------------------------------------------------- several ranks
def _full_and_local(rank: int, world_size: int, foreign_local: dict[str, torch.Tensor]) -> None:
    group = torch.distributed.group.WORLD
    ref = M.build("lm", seed=0)
    model = build("lm", group)
    sd = model.state_dict()
    assert list(sd) == list(ref.state_dict())
    assert_same(sd, ref.state_dict())
    # load a different full dict on every rank's shards, then read it back in full
    donor = M.build("lm", seed=5).state_dict()
    model.load_state_dict(donor)
    assert_same(model.state_dict(), donor)
    # local round trip
    saved = snapshot(model)
    train("lm", model, 1, rank)
    model.load_local_state_dict(saved)
    assert_same(snapshot(model), saved)
    # a local dict from another world size (or rank) is refused with the reason, model unchanged
    with pytest.raises(ValueError, match="same world size"):
        model.load_local_state_dict(foreign_local)
    assert_same(snapshot(model), saved)
    # a bad full dict on ONE rank: every rank raises, nobody writes
    bad = dict(donor) if rank == 0 else {**donor, "ln_f.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="ln_f.weight" if rank else "another rank"):
        model.load_state_dict(bad)
    assert_same(snapshot(model), saved)
    _per_rank_experts(rank, world_size)


def _per_rank_experts(rank: int, world_size: int) -> None:
    # Experts sharded over size-one groups: the full dict holds this rank's own expert; one DCP key cannot.
    groups = [torch.distributed.new_group([r]) for r in range(world_size)]
    model = FSDP(M.build("moe", seed=0, expert_seed=rank, expert_wrap_fn=lambda m: FSDP(m, process_group=groups[rank])))
    want = M.build("moe", seed=0, expert_seed=rank).state_dict()
    assert_same(model.state_dict(), want)
    with pytest.raises(NotImplementedError, match=r"\['expert'\]"):
        fsdp_sd.sharded_state_dict(model)


def test_full_and_local_state_dicts_across_ranks() -> None:
    # world size 4 is covered by the DCP test; a local dict from world size 1 must be refused at world size 2
    single = build("lm", DUMMY)
    run_distributed(_full_and_local, 2, single.local_state_dict())


def test_unwrapped_root_loads_through_torch_recursion() -> None:
    # auto_wrap leaves the root plain: torch's load_state_dict recursion reaches the wrapped units itself.
    donor = M.build("batchnorm", seed=4)
    donor.bn.running_mean.uniform_()
    donor.body[1].running_var.uniform_(1, 2)

    def wrap_body(body: nn.Module) -> nn.Module:
        body[0] = FSDP(body[0], process_group=DUMMY)  # a unit inside a unit
        return FSDP(body, process_group=DUMMY)

    model = M.build("batchnorm", seed=0, wrap_fn=wrap_body)
    assert isinstance(model.body.module[0], FSDP) and model.body.module[0].flat_params
    result = model.load_state_dict(donor.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    assert_same(model.state_dict(), donor.state_dict())
    bad = {**donor.state_dict(), "body.0.weight": torch.zeros(2, 2), "body.7.weight": torch.zeros(1)}
    # torch's recursion names a unit nested in a unit by the path it visits (body.module.0), not the clean key
    with pytest.raises(RuntimeError, match=r"(?s)body\.7\.weight.*'body\.module\.0\.weight' has shape \(2, 2\)"):
        model.load_state_dict(bad)
