"""fairscale's spellings of the wrap API: enable_wrap's positional policy, ConfigAutoWrap, its test helper group."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.nn.wrap import ConfigAutoWrap, auto_wrap, default_auto_wrap_policy, enable_wrap, wrap


class Wrapper(nn.Module):
    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.module = module
        self.kwargs = kwargs


class DummyProcessGroup:
    """Shaped like fairscale's test helper (fairscale.fair_dev.testing.testing.DummyProcessGroup)."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def test_enable_wrap_takes_the_policy_first_and_the_wrapper_by_keyword() -> None:
    policy = functools.partial(default_auto_wrap_policy, min_num_params=20)
    with enable_wrap(policy, wrapper_cls=Wrapper, tag=1) as config:
        model = auto_wrap(nn.Sequential(nn.Linear(4, 4), nn.Linear(2, 2)))
    assert config.auto_wrap_policy is policy and config.wrapper_cls is Wrapper
    assert isinstance(model[0], Wrapper) and model[0].kwargs == {"tag": 1}
    assert type(model[1]) is nn.Linear  # 6 parameters, below the threshold


def test_fairscale_helper_group_works_with_fsdp_without_init_process_group() -> None:
    assert not torch.distributed.is_initialized()
    with enable_wrap(wrapper_cls=FSDP, flatten_parameters=False, process_group=DummyProcessGroup(0, 1)):
        layer = wrap(nn.Linear(5, 5))
        flat = wrap(nn.Linear(5, 5), flatten_parameters=True)
    assert isinstance(layer, FSDP) and layer.flatten_parameters is False and layer.world_size == 1
    assert flat.flatten_parameters is True
    assert layer(torch.randn(2, 5)).shape == (2, 5)


def test_config_auto_wrap_reads_the_active_context() -> None:
    assert ConfigAutoWrap.in_autowrap_context is False
    assert ConfigAutoWrap.wrapper_cls is None and ConfigAutoWrap.kwargs == {}
    with enable_wrap(wrapper_cls=Wrapper, tag=2):
        assert ConfigAutoWrap.in_autowrap_context is True
        assert ConfigAutoWrap.wrapper_cls is Wrapper and ConfigAutoWrap.kwargs == {"tag": 2}
        assert ConfigAutoWrap.auto_wrap_policy is default_auto_wrap_policy
        assert ConfigAutoWrap.move_module_cuda_half is False
    with pytest.raises(AttributeError):
        ConfigAutoWrap.in_autowrap_context = True  # type: ignore[misc]
    assert ConfigAutoWrap.in_autowrap_context is False


def test_config_auto_wrap_is_a_context_like_enable_wrap() -> None:
    with ConfigAutoWrap(None, wrapper_cls=Wrapper, tag=3):
        layer = wrap(nn.Linear(2, 2))
    assert isinstance(layer, Wrapper) and layer.kwargs == {"tag": 3}
    assert ConfigAutoWrap.in_autowrap_context is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error given without CUDA")
def test_move_module_cuda_half_without_cuda_is_refused_up_front() -> None:
    with (
        pytest.raises(ValueError, match="move_module_cuda_half"),
        enable_wrap(wrapper_cls=Wrapper, move_module_cuda_half=True),
    ):
        pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="moves modules to CUDA")
def test_move_module_cuda_half_moves_before_wrapping() -> None:
    with enable_wrap(wrapper_cls=Wrapper, move_module_cuda_half=True, tag=4):
        layer = wrap(nn.Linear(2, 2))
    assert layer.kwargs == {"tag": 4}  # the flag is not a wrapper argument
    assert layer.module.weight.is_cuda and layer.module.weight.dtype == torch.float16
