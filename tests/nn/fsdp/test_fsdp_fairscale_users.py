"""What code written against fairscale's FSDP by other projects relies on, beyond fairscale's own tests.

Optimizer wrappers that are not torch optimizers, ``local_state_dict``'s ``nn.Module.state_dict`` keywords, and
``fsdp.module.module`` (fairscale's flattening wrapper between the unit and the user's module).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from shardkit.distributed import DummyProcessGroup
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.testing import models as M
from shardkit.testing import run_distributed


def _one_rank() -> DummyProcessGroup:
    return DummyProcessGroup(rank=0, size=1)


class OptimizerFacade:
    """An optimizer wrapper as training frameworks write them: not a torch optimizer, no ``state`` attribute,
    only ``param_groups`` and ``state_dict()`` passed through to the optimizer inside."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self._inner = inner

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._inner.param_groups

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._inner.load_state_dict(state)

    def step(self) -> None:
        self._inner.step()

    def zero_grad(self) -> None:
        self._inner.zero_grad()


def _nested_lm(group: Any) -> FSDP:
    model = M.build("lm", seed=0)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = FSDP(block, process_group=group)
    return FSDP(model, process_group=group)


def _train(model: nn.Module, opt: Any, rank: int, world_size: int) -> None:
    per_rank = 4 // world_size
    for step in range(2):
        x, y = M.lm_batch(M.LMConfig(), 4, seed=100 + step)
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad()
        M.TransformerLM.loss_fn(model(x[rows]), y[rows]).backward()
        opt.step()


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for pid in a:
        for key in a[pid]:
            va, vb = a[pid][key], b[pid][key]
            if isinstance(va, torch.Tensor) and not torch.equal(va, vb):
                return False
    return True


def _optimizer_facade(rank: int, world_size: int) -> bool:
    model = _nested_lm(None if world_size > 1 else _one_rank())
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    facade = OptimizerFacade(inner)
    _train(model, facade, rank, world_size)
    via_facade = model.gather_full_optim_state_dict(facade)
    via_optimizer = model.gather_full_optim_state_dict(inner)
    if rank != 0:
        return via_facade is None and via_optimizer is None
    assert via_facade is not None and via_optimizer is not None
    same = _same_state(via_facade["state"], via_optimizer["state"])
    # The resumed shard loads back into the wrapper and gives the state it had.
    shard = model.get_shard_from_optim_state_dict(via_facade)
    return same and via_facade["param_groups"] == via_optimizer["param_groups"] and bool(shard["state"])


def test_gather_full_optim_state_dict_takes_an_optimizer_wrapper() -> None:
    assert _optimizer_facade(0, 1)


def test_gather_full_optim_state_dict_takes_an_optimizer_wrapper_two_ranks() -> None:
    assert run_distributed(_optimizer_facade, 2, timeout_s=120) == [True, True]


def test_gather_full_optim_state_dict_refuses_what_is_not_an_optimizer() -> None:
    model = FSDP(nn.Linear(2, 2), process_group=_one_rank())
    with pytest.raises(TypeError, match="param_groups"):
        model.gather_full_optim_state_dict(object())  # type: ignore[arg-type]


def _one_rank_passes_a_bad_optimizer(rank: int, world_size: int) -> str:
    model = FSDP(nn.Linear(2, 2))
    optim: Any = torch.optim.SGD(model.parameters(), lr=0.1) if rank == 0 else object()
    try:
        model.gather_full_optim_state_dict(optim)
    except (TypeError, RuntimeError) as error:
        return str(error)
    return "no error"


def test_a_bad_optimizer_on_one_rank_is_refused_on_every_rank() -> None:
    messages = run_distributed(_one_rank_passes_a_bad_optimizer, 2, timeout_s=120)
    assert all("param_groups" in m and "model.parameters()" in m for m in messages), messages


def test_local_state_dict_takes_state_dict_keywords() -> None:
    model = _nested_lm(_one_rank())
    plain = model.local_state_dict()
    target: dict[str, Any] = {"already": torch.zeros(1)}
    out = model.local_state_dict(destination=target, prefix="model.", keep_vars=True)
    assert out is target and "already" in out
    assert [k for k in out if k != "already"] == [f"model.{k}" for k in plain]
    shard_key = next(k for k in plain if "flat_param" in k)
    assert out[f"model.{shard_key}"] is dict(model.named_parameters())[shard_key]  # keep_vars: the parameter
    assert not isinstance(plain[shard_key], nn.Parameter)
    # The positional form nn.Module.state_dict used to take, and the unprefixed dict still loads back.
    positional = model.local_state_dict(None, "p.", False)
    assert set(positional) == {f"p.{k}" for k in plain}
    model.load_local_state_dict(model.local_state_dict())


def test_local_state_dict_refuses_unknown_keywords() -> None:
    model = FSDP(nn.Linear(2, 2), process_group=_one_rank())
    with pytest.raises(TypeError, match="destination, prefix, keep_vars"):
        model.local_state_dict(prefixx="a.")


class Named(nn.Module):
    """A user module with its own attribute and method."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.greeting = "hello"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def twice(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


def test_module_module_reaches_the_users_module() -> None:
    user = Named()
    model = FSDP(user, process_group=_one_rank())
    assert model.module.module is user  # fairscale: the flattening wrapper's .module
    # Reads on the wrapper level fall through to the user's module, as fairscale's do.
    assert model.module.greeting == "hello"
    assert model.module.fc is user.fc
    assert torch.equal(model.module.twice(torch.ones(1)), 2 * torch.ones(1))
    assert isinstance(model.module, Named)
    assert model.module == user and hash(model.module) == hash(user)
    # Nothing was added to the user's module.
    assert "module" not in vars(user) and "module" not in user._modules
    assert model.module.named_parameters is not None and dict(model.module.named_parameters()) == dict(
        user.named_parameters()
    )
    # Unflattened (fairscale: no wrapper in between): .module is the user's module itself.
    other = Named()
    unflat = FSDP(other, process_group=_one_rank(), flatten_parameters=False)
    assert unflat.module is other


def test_module_module_names_the_missing_attribute() -> None:
    model = FSDP(Named(), process_group=_one_rank())
    with pytest.raises(AttributeError, match="'Named' object has no attribute 'nothing'"):
        _ = model.module.nothing


def _modules(model: nn.Module) -> Iterator[nn.Module]:
    yield from model.modules()


def test_module_level_is_not_a_new_module_in_the_tree() -> None:
    user = Named()
    model = FSDP(user, process_group=_one_rank())
    assert [type(m).__name__ for m in _modules(model)] == ["FullyShardedDataParallel", "Named", "Linear"]
    assert list(model.state_dict()) == ["fc.weight", "fc.bias"]
