"""One process (a size-1 DummyProcessGroup): the wrapper's own behaviour, bad inputs, fp16, state_dict, modes."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from slowmo_reference import Case, StarGraph, flat_params, make_batch, make_model, simulate

from shardkit.distributed import DummyProcessGroup
from shardkit.nn import SlowMoBaseAlgorithm as FromNn
from shardkit.nn.data_parallel import SlowMoBaseAlgorithm, SlowMoDistributedDataParallel
from shardkit.nn.slowmo import ParamForm, RingGraph, UniformMixing


def _wrap(model: torch.nn.Module, **kwargs: Any) -> SlowMoDistributedDataParallel:
    return SlowMoDistributedDataParallel(model, 1, global_group=DummyProcessGroup(0, 1), **kwargs)


def _train(net: SlowMoDistributedDataParallel, opt: Any, steps: int, fp32: Any = None) -> None:
    for step in range(steps):
        x, y = make_batch(0, step)
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        net.perform_slowmo(opt, fp32_params=fp32)


def test_compatibility_import_paths_name_the_same_class() -> None:
    from shardkit.experimental.nn.data_parallel import SlowMoDistributedDataParallel as Experimental

    assert Experimental is SlowMoDistributedDataParallel and FromNn is SlowMoBaseAlgorithm


def test_without_slow_momentum_one_process_trains_exactly_like_the_bare_module() -> None:
    bare, wrapped = make_model(), make_model()
    net = _wrap(wrapped, slowmo_momentum=0.0, slowmo_lr=1.0)
    _train(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), 6)
    bare_opt = torch.optim.SGD(bare.parameters(), lr=0.1, momentum=0.9)
    for step in range(6):
        x, y = make_batch(0, step)
        F.mse_loss(bare(x), y).backward()
        bare_opt.step()
        bare_opt.zero_grad()
    assert torch.equal(flat_params(bare), flat_params(wrapped))


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_one_node_slow_momentum_follows_the_simulation(memory_efficient: bool) -> None:
    case = Case("one", slowmo_lr=1.3, slowmo_momentum=0.5, slowmo_frequency=3, memory_efficient=memory_efficient)
    net = _wrap(make_model(), **case.wrapper_kwargs(0, 1))
    opt = torch.optim.SGD(net.parameters(), lr=case.lr)
    expected = simulate(case, 1, 1)
    for step in range(case.steps):
        _train_step = make_batch(0, step)
        F.mse_loss(net(_train_step[0]), _train_step[1]).backward()
        opt.step()
        opt.zero_grad()
        net.perform_slowmo(opt)
        assert torch.allclose(flat_params(net.module), expected[step][0][0], rtol=1e-5, atol=1e-6)


def test_slow_momentum_uses_each_parameter_groups_learning_rate() -> None:
    # With alpha=1 and an outer step every step: x1 is the first local step, and the second outer step gives
    # x2 - beta * (gamma2 / gamma1) * (x0 - x1), where gamma is the learning rate of each parameter's group.
    wrapped, bare = make_model(), make_model()
    net = _wrap(wrapped, slowmo_momentum=0.5, slowmo_frequency=1)

    def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[2].parameters()}], lr=0.01
        )

    opt, bare_opt = optimizer(wrapped), optimizer(bare)
    x0 = flat_params(bare)
    trajectory = []
    for step in range(2):
        x, y = make_batch(0, step)
        for model, o in ((net, opt), (bare, bare_opt)):
            F.mse_loss(model(x), y).backward()
            o.step()
            o.zero_grad()
        net.perform_slowmo(opt)
        trajectory.append(flat_params(bare))
        for o in (opt, bare_opt):
            o.param_groups[0]["lr"] = 0.05  # the first group's rate halves, the second's stays
    ratio = torch.cat([torch.full((p.numel(),), 0.5) for p in wrapped[0].parameters()] + [torch.ones(24)])
    x1, x2 = trajectory
    assert torch.allclose(flat_params(wrapped), x2 - 0.5 * ratio * (x0 - x1), atol=1e-6)


def test_world_size_not_a_multiple_of_nprocs_per_node_raises_before_touching_the_model() -> None:
    model = make_model()
    with pytest.raises(ValueError, match="not a multiple of nprocs_per_node=4"):
        SlowMoDistributedDataParallel(model, 4, global_group=DummyProcessGroup(0, 6))
    assert all(p._post_accumulate_grad_hooks is None for p in model.parameters())
    with pytest.raises(ValueError, match="nprocs_per_node must be an integer"):
        SlowMoDistributedDataParallel(model, 0, global_group=DummyProcessGroup(0, 1))
    with pytest.raises(ValueError, match="process_rank=3"):
        SlowMoDistributedDataParallel(model, 1, global_group=DummyProcessGroup(0, 2), process_rank=3)


def test_unknown_graph_and_mixing_combinations_raise_in_the_constructor() -> None:
    group = DummyProcessGroup(0, 4)
    sgp = SlowMoBaseAlgorithm.SGP
    with pytest.raises(ValueError, match="push-pull"):
        SlowMoDistributedDataParallel(
            make_model(), 1, slowmo_base_algorithm=sgp, graph=StarGraph(0, 4), push_sum=False, global_group=group
        )
    with pytest.raises(ValueError, match="different graph"):
        SlowMoDistributedDataParallel(
            make_model(),
            1,
            slowmo_base_algorithm=sgp,
            graph=RingGraph(0, 4),
            mixing=UniformMixing(RingGraph(0, 4)),
            global_group=group,
        )
    with pytest.raises(ValueError, match="unknown slowmo_base_algorithm"):
        SlowMoDistributedDataParallel(make_model(), 1, slowmo_base_algorithm="allreduce", global_group=group)


def test_slowmo_frequency_off_the_localsgd_grid_warns() -> None:
    with pytest.warns(UserWarning, match="not a multiple of localsgd_frequency"):
        _wrap(make_model(), slowmo_frequency=10, localsgd_frequency=3)


def test_half_parameters_without_fp32_params_warn_once() -> None:
    net = _wrap(make_model().half(), slowmo_frequency=2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="fp32_params"):
        net.perform_slowmo(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net.perform_slowmo(opt)


def test_fp32_params_carry_the_algorithm_and_refresh_the_half_parameters() -> None:
    model = make_model().half()
    master = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).requires_grad_()
    net = _wrap(model, slowmo_frequency=1, slowmo_momentum=0.5, slowmo_lr=2.0)
    opt = torch.optim.SGD([master], lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3):
            master.grad = torch.full_like(master, 0.01 * (step + 1))
            opt.step()
            net.perform_slowmo(opt, fp32_params=master)
    assert torch.equal(flat_params(model), master.detach().half())
    assert not torch.equal(flat_params(model).float(), master.detach())  # master keeps bits fp16 cannot hold


def test_state_dict_round_trip_keeps_the_push_sum_weight_and_form() -> None:
    net = _wrap(make_model(), slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP, slowmo_momentum=0.0)
    net._push_sum.set_weight(0.75)  # type: ignore[union-attr]
    with torch.no_grad():
        net(make_batch(0, 0)[0])  # forward leaves the parameters de-biased
    assert net._push_sum.form is ParamForm.DEBIASED  # type: ignore[union-attr]
    state = net.state_dict()
    assert state["ps_weight"].item() == 0.75 and state["is_sgp_ps_numerator"] is False
    numerators = flat_params(net.module) * 0.75

    other = _wrap(make_model(), slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP, slowmo_momentum=0.0)
    other.load_state_dict(state)  # strict: the push-sum entries are consumed, not unexpected
    assert other.state_dict()["ps_weight"].item() == 0.75
    assert torch.allclose(flat_params(other.module), numerators)  # converted back to numerators after loading
    with pytest.raises(RuntimeError, match="Missing key"):
        other.load_state_dict({"ps_weight": torch.ones(1)})


def test_loading_resets_the_slow_momentum_anchor_to_the_loaded_point() -> None:
    source = make_model()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    net = _wrap(make_model(), slowmo_frequency=1, slowmo_momentum=0.0, slowmo_lr=0.5)
    net.load_state_dict({f"module.{k}": v for k, v in source.state_dict().items()})
    loaded = flat_params(source)
    _train(net, torch.optim.SGD(net.parameters(), lr=0.1), 1)
    local = source  # the same SGD step without SlowMo, from the loaded point
    opt = torch.optim.SGD(local.parameters(), lr=0.1)
    x, y = make_batch(0, 0)
    F.mse_loss(local(x), y).backward()
    opt.step()
    # alpha = 0.5, beta = 0: the outer step lands halfway between the loaded point and the local step.
    assert torch.allclose(flat_params(net.module), loaded + 0.5 * (flat_params(local) - loaded), atol=1e-6)


def test_train_and_eval_switch_modes() -> None:
    net = _wrap(make_model())
    assert net.eval() is net and not net.training and not net.module.training
    assert net.train() is net and net.training
