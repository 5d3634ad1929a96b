"""OSS in one process (DummyProcessGroup of size 1) and its pure pieces: partition, bad input, param groups."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardkit.distributed import DummyProcessGroup
from shardkit.optim import OSS
from shardkit.optim.oss import OSS as OSSFromCompatPath
from shardkit.optim.zero1.partition import Partition, assign_owners
from testkit import max_param_diff, tiny_model, train_harness_model

SOLO = DummyProcessGroup(rank=0, size=1)


def _tensors(*sizes: int, frozen: tuple[int, ...] = ()) -> list[torch.Tensor]:
    return [torch.zeros(n, requires_grad=i not in frozen) for i, n in enumerate(sizes)]


def test_compat_import_path() -> None:
    assert OSSFromCompatPath is OSS


def test_assign_owners_balances_and_is_deterministic() -> None:
    sizes = (300, 7, 120, 120, 64, 64, 9, 500, 33, 1)
    params = _tensors(*sizes)
    owners = assign_owners(params, 3)
    assert owners == assign_owners(_tensors(*sizes), 3)
    load = [sum(n for n, o in zip(sizes, owners) if o == r) for r in range(3)]
    assert max(load) - min(load) <= max(sizes) // 2, load
    assert assign_owners(params, 1) == [0] * len(sizes)


def test_frozen_params_are_dealt_but_not_counted() -> None:
    params = _tensors(100, 100, 5, 5, frozen=(2, 3))
    partition = Partition.build([{"params": params}], 2)
    assert sorted(partition.param_to_rank().values()) == [0, 1]
    assert params[2] not in partition.param_to_rank()
    assert {partition.owner[params[2]], partition.owner[params[3]]} == {0, 1}
    with pytest.raises(ValueError, match="world_size"):
        assign_owners(params, 0)


def test_partition_keeps_groups_and_names() -> None:
    a, b, c = _tensors(10, 20, 30)
    groups = [{"params": [a, b], "param_names": ["a", "b"], "lr": 0.1}, {"params": [c], "lr": 0.2}]
    partition = Partition.build(groups, 2)
    for rank_groups in partition.rank_groups:
        assert [g["lr"] for g in rank_groups] == [0.1, 0.2]
        for g in rank_groups:
            if "param_names" in g:
                assert len(g["param_names"]) == len(g["params"])
    owned = [p for rank_groups in partition.rank_groups for g in rank_groups for p in g["params"]]
    assert sorted(map(id, owned)) == sorted(map(id, (a, b, c)))


def test_optimizer_instance_is_rejected_with_a_fix() -> None:
    model = nn.Linear(4, 4)
    instance = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TypeError, match=r"optimizer class.*optim=torch\.optim\.SGD"):
        OSS(model.parameters(), optim=instance, group=SOLO)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer class"):
        OSS(model.parameters(), optim="sgd", group=SOLO)  # type: ignore[arg-type]
    assert instance.param_groups[0]["lr"] == 0.1 and not instance.state
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_no_process_group_says_what_to_do() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        OSS(nn.Linear(2, 2).parameters(), lr=0.1)


def test_state_dict_needs_consolidation_first() -> None:
    model, ref = tiny_model("nested"), tiny_model("nested")
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, group=SOLO, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    train_harness_model("nested", model, opt, 0, range(1))
    with pytest.raises(RuntimeError, match=r"consolidate_state_dict\(recipient_rank=R\) on every rank"):
        opt.state_dict()
    # Nothing was disturbed: training goes on exactly like the plain optimizer.
    train_harness_model("nested", ref, ref_opt, 0, range(1))
    for step in (1, 2):
        train_harness_model("nested", model, opt, 0, [step])
        train_harness_model("nested", ref, ref_opt, 0, [step])
    assert max_param_diff(model, ref) == 0.0
    opt.consolidate_state_dict()
    assert opt.state_dict()["param_groups"] == ref_opt.state_dict()["param_groups"]
    train_harness_model("nested", model, opt, 0, [3])
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        opt.state_dict()  # a step makes the consolidated copy stale


def test_bad_state_dict_changes_nothing() -> None:
    model = tiny_model("nested")
    opt = OSS(model.parameters(), optim=torch.optim.SGD, group=SOLO, lr=0.1, momentum=0.9)
    train_harness_model("nested", model, opt, 0, range(1))
    opt.consolidate_state_dict()
    good = opt.state_dict()
    bad = copy.deepcopy(good)
    bad["param_groups"][0]["lr"] = 5.0
    bad["param_groups"].append(copy.deepcopy(bad["param_groups"][0]))
    momentum = {p: s["momentum_buffer"].clone() for p, s in opt.optim.state.items()}
    with pytest.raises(ValueError, match="2 param groups but this OSS has 1"):
        opt.load_state_dict(bad)
    with pytest.raises(ValueError, match=r"plain torch\.optim state dict"):
        opt.load_state_dict({"param_groups": []})
    assert opt.param_groups[0]["lr"] == opt.optim.param_groups[0]["lr"] == 0.1
    assert all(torch.equal(opt.optim.state[p]["momentum_buffer"], m) for p, m in momentum.items())


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_single_rank_matches_plain_optimizer_with_scheduler(optim: str) -> None:
    cls = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[optim]
    model, ref = tiny_model("lm"), tiny_model("lm")
    opt = OSS(model.parameters(), optim=cls, group=SOLO, lr=0.05)
    ref_opt = cls(ref.parameters(), lr=0.05)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ref_opt)]
    for step in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            train_harness_model("lm", m, o, 0, [step])
        for s in scheds:
            s.step()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.05 / 8
    assert max_param_diff(model, ref) == 0.0
    train_harness_model("lm", model, opt, 0, [3])
    assert opt.optim.param_groups[0]["lr"] == 0.05 / 8  # the scheduler's value reached the local optimizer


def test_param_group_edits_flow_both_ways() -> None:
    model, ref = tiny_model("nested"), tiny_model("nested")
    opt = OSS(model.parameters(), optim=torch.optim.SGD, group=SOLO, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    assert opt.param_groups[0]["momentum"] == 0  # the local optimizer's defaults show on OSS
    opt.param_groups[0]["lr"] = 0.3  # user edits OSS
    ref_opt.param_groups[0]["lr"] = 0.3
    train_harness_model("nested", model, opt, 0, [0])
    train_harness_model("nested", ref, ref_opt, 0, [0])
    assert opt.optim.param_groups[0]["lr"] == 0.3
    opt.optim.param_groups[0]["lr"] = 0.02  # user edits the wrapped optimizer
    ref_opt.param_groups[0]["lr"] = 0.02
    train_harness_model("nested", model, opt, 0, [1])
    train_harness_model("nested", ref, ref_opt, 0, [1])
    assert opt.param_groups[0]["lr"] == 0.02
    assert max_param_diff(model, ref) == 0.0


def test_add_param_group_matches_plain_and_rejects_duplicates() -> None:
    model, ref = tiny_model("nested"), tiny_model("nested")
    first, rest = list(model.parameters())[:4], list(model.parameters())[4:]
    ref_first, ref_rest = list(ref.parameters())[:4], list(ref.parameters())[4:]
    opt = OSS(first, optim=torch.optim.AdamW, group=SOLO, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref_first, lr=1e-2)
    train_harness_model("nested", model, opt, 0, [0])
    train_harness_model("nested", ref, ref_opt, 0, [0])
    opt.add_param_group({"params": rest, "lr": 3e-3})
    ref_opt.add_param_group({"params": ref_rest, "lr": 3e-3})
    assert len(opt.optim.param_groups) == 2 and opt.optim.param_groups[1]["lr"] == 3e-3
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": rest[:1]})
    assert len(opt.param_groups) == len(opt.optim.param_groups) == 2
    train_harness_model("nested", model, opt, 0, [1, 2])
    train_harness_model("nested", ref, ref_opt, 0, [1, 2])
    assert max_param_diff(model, ref) == 0.0


@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.0])
def test_clip_grad_norm_single_rank(norm_type: float) -> None:
    model, ref = tiny_model("nested"), tiny_model("nested")
    opt = OSS(model.parameters(), group=SOLO, lr=0.1)
    for m in (model, ref):
        m(torch.ones(3, 8)).pow(2).sum().mul(10).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type)
    got = opt.clip_grad_norm(0.5, norm_type, filter_params_fn=lambda ps: ps)
    assert torch.allclose(got, expected, rtol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-9)
    first = next(model.parameters())
    only_first = opt.clip_grad_norm(1e9, norm_type, filter_params_fn=lambda ps: ps[:1])
    assert torch.allclose(only_first, torch.linalg.vector_norm(first.grad, norm_type), rtol=1e-6)


def test_dummy_group_of_four_shows_the_sharding() -> None:
    model = tiny_model("lm")
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, group=DummyProcessGroup(rank=1, size=4), lr=1e-2)
    assert (opt.rank, opt.world_size, opt.global_rank) == (1, 4, 1)
    per_rank = opt.partition_parameters()
    assert len(per_rank) == 4 and all(len(groups) == 1 for groups in per_rank)
    local = [p for g in opt.optim.param_groups for p in g["params"]]
    assert [id(p) for p in local] == [id(p) for p in per_rank[1][0]["params"]]
    assert set(opt.param_to_rank.values()) == {0, 1, 2, 3}
    sizes = [sum(p.numel() for p in groups[0]["params"]) for groups in per_rank]
    assert max(sizes) - min(sizes) <= max(p.numel() for p in model.parameters())
