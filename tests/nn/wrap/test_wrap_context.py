"""enable_wrap / wrap / auto_wrap mechanics with a stand-in wrapper (no FSDP, no processes)."""

import threading
from typing import Any

import pytest
import torch
from torch import nn

from shardkit.nn.wrap import auto_wrap, current_wrap_config, enable_wrap, wrap


class Wrapper(nn.Module):
    """Stands in for FSDP: keeps the module and exposes every wrapper argument as an attribute."""

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.module = module
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class OtherWrapper(Wrapper):
    pass


def test_wrap_is_a_no_op_outside_a_context() -> None:
    layer = nn.Linear(3, 3)
    assert wrap(layer) is layer
    assert wrap(layer, flag=True) is layer
    assert auto_wrap(layer, min_num_params=1) is layer
    assert current_wrap_config() is None


def test_wrap_passes_context_kwargs_and_overrides_win() -> None:
    with enable_wrap(wrapper_cls=Wrapper, a=1, b=2):
        wrapped = wrap(nn.Linear(3, 3), b=3, c=4)
    assert isinstance(wrapped, Wrapper)
    assert wrapped.kwargs == {"a": 1, "b": 3, "c": 4}
    assert (wrapped.a, wrapped.b, wrapped.c) == (1, 3, 4)


def test_per_module_wrapper_config_sits_between_context_and_overrides() -> None:
    layer = nn.Linear(3, 3)
    layer.wrapper_config = {"a": 10, "b": 20}
    with enable_wrap(wrapper_cls=Wrapper, a=1, b=2, c=3):
        wrapped = wrap(layer, b=30)
    assert wrapped.kwargs == {"a": 10, "b": 30, "c": 3}


def test_wrap_does_not_wrap_a_wrapper_twice() -> None:
    with enable_wrap(wrapper_cls=Wrapper):
        once = wrap(nn.Linear(3, 3))
        assert wrap(once) is once


def test_nested_contexts_override_then_restore() -> None:
    with enable_wrap(wrapper_cls=Wrapper, level="outer"):
        with enable_wrap(wrapper_cls=OtherWrapper, level="inner"):
            inner = wrap(nn.Linear(2, 2))
        outer = wrap(nn.Linear(2, 2))
    after = nn.Linear(2, 2)
    assert type(inner) is OtherWrapper and inner.level == "inner"
    assert type(outer) is Wrapper and outer.level == "outer"
    assert wrap(after) is after


def test_context_is_restored_after_an_exception() -> None:
    with pytest.raises(RuntimeError, match="boom"), enable_wrap(wrapper_cls=Wrapper):
        raise RuntimeError("boom")
    assert current_wrap_config() is None
    layer = nn.Linear(2, 2)
    assert wrap(layer) is layer


def test_contexts_are_isolated_between_threads() -> None:
    entered = threading.Event()
    release = threading.Event()
    seen: dict[str, Any] = {}

    def other_thread() -> None:
        # Runs while the main thread is inside its context: must not see it, and opens its own.
        seen["outside"] = wrap(nn.Linear(2, 2))
        with enable_wrap(wrapper_cls=OtherWrapper, who="thread"):
            entered.set()
            release.wait(10)
            seen["inside"] = wrap(nn.Linear(2, 2))

    with enable_wrap(wrapper_cls=Wrapper, who="main"):
        thread = threading.Thread(target=other_thread)
        thread.start()
        assert entered.wait(10)
        # The thread's context is open now; the main thread still sees only its own.
        main_wrapped = wrap(nn.Linear(2, 2))
        release.set()
        thread.join(10)
    assert type(seen["outside"]) is nn.Linear
    assert type(seen["inside"]) is OtherWrapper and seen["inside"].who == "thread"
    assert type(main_wrapped) is Wrapper and main_wrapped.who == "main"


def test_bad_wrapper_cls_and_policy_are_rejected() -> None:
    with pytest.raises(TypeError, match="wrapper_cls"), enable_wrap(wrapper_cls=42):  # type: ignore[arg-type]
        pass
    with pytest.raises(TypeError, match="auto_wrap_policy"), enable_wrap(wrapper_cls=Wrapper, auto_wrap_policy=3):
        pass
    with enable_wrap(wrapper_cls=Wrapper), pytest.raises(ValueError, match="min_num_params"):
        auto_wrap(nn.Linear(2, 2), auto_wrap_policy=lambda m, r, n: True, min_num_params=1)


def test_seed_example_structure_with_stand_in_wrapper() -> None:
    # The fairscale documentation example, with the stand-in wrapper instead of FSDP.
    tfmr = nn.Transformer(num_encoder_layers=2, num_decoder_layers=2)
    with enable_wrap(wrapper_cls=Wrapper, mixed_precision=True, flatten_parameters=True):
        l1 = wrap(nn.Linear(5, 5))
        assert isinstance(l1, Wrapper)
        tfmr_auto_wrapped = auto_wrap(tfmr, min_num_params=1e6)
    assert isinstance(tfmr_auto_wrapped, nn.Transformer)
    for stack in (tfmr_auto_wrapped.encoder.layers, tfmr_auto_wrapped.decoder.layers):
        for layer in stack:
            assert isinstance(layer, Wrapper)
            assert layer.mixed_precision and layer.flatten_parameters
            assert isinstance(layer.module.linear1, Wrapper)
            assert isinstance(layer.module.linear2, Wrapper)
            assert not isinstance(layer.module.self_attn, Wrapper)
            assert not isinstance(layer.module.self_attn.out_proj, Wrapper)
    assert not isinstance(tfmr_auto_wrapped.encoder, Wrapper)
    assert not isinstance(tfmr_auto_wrapped.encoder.layers, Wrapper)


def test_auto_wrap_is_idempotent_and_skips_existing_wrappers() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10)))
    with enable_wrap(wrapper_cls=Wrapper):
        model[1][0] = wrap(model[1][0])
        pre_wrapped = model[1][0]
        counts: list[tuple[str, int]] = []

        def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
            counts.append((type(module).__name__, nonwrapped_numel))
            return recurse or isinstance(module, nn.Linear)

        model = auto_wrap(model, auto_wrap_policy=policy)
        again = auto_wrap(model, auto_wrap_policy=policy)
    assert again is model
    assert model[1][0] is pre_wrapped and isinstance(pre_wrapped.module, nn.Linear)
    assert isinstance(model[0], Wrapper) and isinstance(model[1][1], Wrapper)
    # The inner Sequential held 220 parameters, 110 of them already in a wrapper before auto_wrap started.
    assert ("Sequential", 110) in counts


def test_shared_submodule_is_wrapped_once_under_every_name() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Module()
    model.a = shared
    model.b = shared
    with enable_wrap(wrapper_cls=Wrapper):
        auto_wrap(model, auto_wrap_policy=lambda m, recurse, n: recurse or isinstance(m, nn.Linear))
    assert isinstance(model.a, Wrapper)
    assert model.a is model.b


def test_auto_wrap_keeps_outputs_and_parameters() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(5, 6)
    expected = model(x)
    params = set(map(id, model.parameters()))
    with enable_wrap(wrapper_cls=Wrapper):
        wrapped = auto_wrap(model, min_num_params=20)
    assert isinstance(wrapped[0], Wrapper) and isinstance(wrapped[2], Wrapper)
    assert set(map(id, wrapped.parameters())) == params
    torch.testing.assert_close(wrapped(x), expected)
