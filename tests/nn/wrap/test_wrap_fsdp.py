"""The wrap helpers with the real FullyShardedDataParallel: the documentation example and training parity."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from shardkit.testing import models as M


def test_seed_documentation_example_verbatim() -> None:
    # The fairscale documentation example with fairscale -> shardkit (and its `l2` typo read as
    # tfmr_auto_wrapped, the variable it meant).
    import torch

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.wrap import auto_wrap, enable_wrap, wrap
    from shardkit.utils.testing import DummyProcessGroup

    tfmr = torch.nn.Transformer(num_encoder_layers=2, num_decoder_layers=2)

    group = DummyProcessGroup(rank=0, size=1)
    fsdp_params = dict(mixed_precision=True, flatten_parameters=True)
    with enable_wrap(wrapper_cls=FSDP, process_group=group, **fsdp_params):
        # Wraps layer in FSDP by default if within context
        l1 = wrap(torch.nn.Linear(5, 5))
        assert isinstance(l1, FSDP)
        assert l1.mixed_precision and l1.flatten_parameters
        # Separately Wraps children modules with more than 1e8 params
        tfmr_auto_wrapped = auto_wrap(tfmr, min_num_params=1e6)
        assert isinstance(tfmr_auto_wrapped, nn.Transformer)
        for l in tfmr_auto_wrapped.encoder.layers:  # noqa: E741 (the example's name)
            assert isinstance(l, FSDP)
            assert l.mixed_precision and l.flatten_parameters
            assert isinstance(l.linear1, FSDP)
            assert isinstance(l.linear2, FSDP)
            assert not isinstance(l.self_attn, FSDP)  # self attention is not auto-wrapped


def test_enable_wrap_defaults_to_fsdp() -> None:
    from shardkit.distributed import DummyProcessGroup
    from shardkit.nn import FullyShardedDataParallel, enable_wrap, wrap

    with enable_wrap(process_group=DummyProcessGroup(rank=0, size=1), reshard_after_forward=False):
        layer = wrap(nn.Linear(3, 3))
    assert isinstance(layer, FullyShardedDataParallel) and not layer.reshard_after_forward


def test_auto_wrapped_lm_trains_like_the_unwrapped_model() -> None:
    from shardkit.distributed import DummyProcessGroup
    from shardkit.nn import FullyShardedDataParallel as FSDP
    from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy

    ref = M.build("lm", seed=0)
    model = M.build("lm", seed=0)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={M.Block})
    with enable_wrap(wrapper_cls=FSDP, auto_wrap_policy=policy, process_group=DummyProcessGroup(rank=0, size=1)):
        model = FSDP(auto_wrap(model), process_group=DummyProcessGroup(rank=0, size=1))
    assert all(isinstance(b, FSDP) for b in model.module.blocks)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
    for step in range(2):
        x, y = M.lm_batch(ref.cfg, 2, seed=step)
        for m, opt in zip((ref, model), opts):
            opt.zero_grad()
            M.TransformerLM.loss_fn(m(x), y).backward()
            opt.step()
    got = model.state_dict()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-5)
