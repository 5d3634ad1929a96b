"""Single-process FSDP tests: flat-parameter layout, argument validation, DummyProcessGroup, state errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardkit.distributed import DummyProcessGroup
from shardkit.nn.fsdp import BackwardPrefetch, CPUOffload, TrainingState
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.nn.fsdp.flat_param import ParamLocation, build_meta
from shardkit.testing import models as M

ONE = DummyProcessGroup(rank=0, size=1)


def test_import_paths() -> None:
    import shardkit.nn as skn
    import shardkit.nn.data_parallel as dp

    assert dp.FullyShardedDataParallel is FSDP and skn.FullyShardedDataParallel is FSDP
    assert dp.TrainingState is TrainingState
    assert skn.CPUOffload is CPUOffload and skn.BackwardPrefetch is BackwardPrefetch


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_layout_shards_cover_every_parameter_once(world_size: int) -> None:
    module = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    owners = [
        (ParamLocation(path, attr, m), p) for path, m in module.named_modules() for attr, p in m._parameters.items()
    ]
    seen = torch.zeros(sum(p.numel() for _, p in owners))
    for rank in range(world_size):
        meta = build_meta(owners, [], world_size, rank)
        assert meta.padded_numel % world_size == 0 and meta.padded_numel - meta.numel < world_size
        assert meta.shard_numel * world_size == meta.padded_numel
        covered = 0
        for piece in meta.shard_slices():
            info = meta.params[piece.param_index]
            start = info.offset + piece.param_start
            seen[start : start + piece.param_end - piece.param_start] += 1
            assert piece.shard_start == start - meta.shard_offset
            covered += piece.param_end - piece.param_start
        assert covered == meta.local_numel
    assert torch.all(seen == 1)
    meta = build_meta(owners, [], world_size, 0)
    full = meta.flatten([p for _, p in owners], torch.device("cpu"))
    for view, (_, p) in zip(meta.views(full), owners):
        assert torch.equal(view, p)
    assert meta.fqns() == ["0.weight", "0.bias", "1.weight", "1.bias"]


def test_dummy_group_trains_exactly_like_the_unwrapped_model() -> None:
    torch.manual_seed(0)
    ref = M.TransformerLM()
    model = copy.deepcopy(ref)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = FSDP(block, process_group=ONE)
    fsdp = FSDP(model, process_group=ONE, flatten_parameters=True)
    assert fsdp.rank == 0 and fsdp.world_size == 1 and fsdp.module.module is model and fsdp.wrapped_module is model
    assert len(list(fsdp.parameters())) == 3  # one flat shard per unit
    # tied embedding / head stored once
    root_meta = fsdp.flat_param_metas[0]
    assert "head.weight" in [s.fqn for s in root_meta.shared]
    assert root_meta.numel == sum(p.numel() for n, p in ref.named_parameters() if not n.startswith("blocks"))
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        x, y = M.lm_batch(ref.cfg, 2, seed=step)
        for m, o in ((ref, opt_ref), (fsdp, opt)):
            o.zero_grad()
            M.TransformerLM.loss_fn(m(x), y).backward()
            o.step()
    with fsdp.summon_full_params():
        got = dict(fsdp.named_parameters())
        assert "head.weight" not in got  # deduplicated, as in the unwrapped model
        assert fsdp.module.head.weight is fsdp.module.embed.weight
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got[n], p, atol=1e-6, rtol=1e-6)


def test_dummy_group_of_size_two_describes_the_sharding() -> None:
    layer = FSDP(nn.Linear(5, 5), process_group=DummyProcessGroup(rank=1, size=2))
    assert layer.world_size == 2 and layer.rank == 1
    (meta,) = layer.flat_param_metas
    assert meta.numel == 30 and meta.padded_numel == 30 and layer.flat_params[0].numel() == 15
    with pytest.raises(RuntimeError, match="only describes a sharding"):
        layer(torch.randn(2, 5))


def test_settings_are_exposed_as_attributes() -> None:
    layer = FSDP(nn.Linear(2, 2), process_group=ONE, mixed_precision=True, flatten_parameters=False)
    assert layer.mixed_precision and not layer.flatten_parameters and layer.reshard_after_forward
    assert layer.compute_dtype == torch.float16 and layer.buffer_dtype == torch.float16
    assert layer.cpu_offload == CPUOffload(offload_params=False) and layer.backward_prefetch is None
    assert FSDP(nn.Linear(2, 2), process_group=ONE, compute_dtype=torch.bfloat16).mixed_precision


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"compute_dtype": torch.int8}, "compute_dtype"),
        ({"mixed_precision": True, "compute_dtype": torch.float32}, "16-bit"),
        ({"fp32_reduce_scatter": True}, "mixed precision"),
        ({"move_grads_to_cpu": True}, "same device"),
        ({"backward_prefetch": "pre"}, "BackwardPrefetch"),
    ],
)
def test_bad_arguments_are_rejected_and_model_untouched(kwargs: dict, match: str) -> None:
    model = nn.Linear(3, 3)
    weight = model.weight
    with pytest.raises((ValueError, TypeError), match=match):
        FSDP(model, process_group=ONE, **kwargs)
    assert model.weight is weight and isinstance(model.weight, nn.Parameter)


def test_unsupported_dtype_mixes() -> None:
    half = nn.Linear(3, 3).half()
    with pytest.raises(TypeError, match=r"'weight' is torch.float16.*model.float\(\)"):
        FSDP(half, process_group=ONE, mixed_precision=True)
    assert isinstance(half.weight, nn.Parameter)
    int_param = nn.Module()
    int_param.steps = nn.Parameter(torch.zeros(2, dtype=torch.long), requires_grad=False)
    with pytest.raises(TypeError, match="buffer"):
        FSDP(int_param, process_group=ONE)
    # fp16 parameters without mixed precision are fine: a separate flat parameter per dtype
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to(torch.bfloat16))
    fsdp = FSDP(mixed, process_group=ONE)
    assert sorted(str(m.dtype) for m in fsdp.flat_param_metas) == ["torch.bfloat16", "torch.float32"]


def test_no_process_group_gives_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="DummyProcessGroup"):
        FSDP(nn.Linear(2, 2))


def test_forward_inside_summon_names_the_unit() -> None:
    model = FSDP(nn.Sequential(FSDP(nn.Linear(2, 2), process_group=ONE), nn.ReLU()), process_group=ONE)
    model(torch.randn(1, 2)).sum().backward()
    with model.summon_full_params(), pytest.raises(RuntimeError, match="summon_full_params"):
        model(torch.randn(1, 2))
    assert model.training_state == TrainingState.IDLE


def test_parameters_are_shards_and_full_params_are_freed() -> None:
    inner = FSDP(nn.Linear(4, 4), process_group=ONE)
    model = FSDP(nn.Sequential(nn.Linear(4, 4), inner), process_group=ONE)
    assert [n for n, _ in model.named_parameters()] == ["flat_param_0", "1.flat_param_0"]
    out = model(torch.randn(2, 4))
    assert model.is_root and inner.is_root is False
    assert inner.unsharded_bytes() == 0  # resharded after forward
    assert model.unsharded_bytes() > 0  # the root keeps its parameters for backward
    assert inner.module.weight.shape == (4, 4)  # a placeholder: shape only, no values
    with pytest.raises(RuntimeError, match="summon_full_params"):
        inner.module.weight + 1
    out.sum().backward()
    assert model.unsharded_bytes() == 0 and inner.unsharded_bytes() == 0
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def test_parameter_tied_across_units_is_rejected() -> None:
    model = M.TransformerLM()
    model.head = FSDP(model.head, process_group=ONE)  # head.weight is tied to embed.weight, left in the root
    before = dict(model.named_parameters())
    with pytest.raises(ValueError, match=r"'embed\.weight' is tied"):
        FSDP(model, process_group=ONE)
    assert dict(model.named_parameters()).keys() == before.keys()


def test_mixed_precision_unit_inside_full_precision_root_casts_its_inputs() -> None:
    inner = FSDP(nn.Linear(4, 4), process_group=ONE, compute_dtype=torch.bfloat16)
    model = FSDP(nn.Sequential(nn.Linear(4, 4), inner), process_group=ONE)
    out = model(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_inference_mode_and_no_grad_eval() -> None:
    torch.manual_seed(0)
    ref = M.NestedWrappedModule()
    model = FSDP(copy.deepcopy(ref), process_group=ONE)
    x = torch.randn(3, 8)
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            torch.testing.assert_close(model(x), ref(x))
        assert model.unsharded_bytes() == 0 and model.training_state == TrainingState.IDLE


def test_training_continues_after_a_backward_that_raised() -> None:
    torch.manual_seed(0)
    ref = M.NestedWrappedModule(wrap_fn=lambda m: m)
    torch.manual_seed(0)
    model = FSDP(M.NestedWrappedModule(wrap_fn=lambda m: FSDP(m, process_group=ONE)), process_group=ONE)
    out = model(torch.randn(2, 8))

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("user hook failed")

    out.register_hook(boom)
    with pytest.raises(ValueError, match="user hook failed"):
        (out * 2).sum().backward()
    x = torch.randn(2, 8)
    for m in (model, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(x).sum().backward()
        opt.step()
    assert all(u.training_state == TrainingState.IDLE for u in model.modules() if isinstance(u, FSDP))
    with model.summon_full_params():
        got = dict(model.named_parameters())
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got[n], p, msg=n)


class _Checkpointed(nn.Module):
    def __init__(self, module: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.m = module
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.m, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("fsdp_outside", [False, True])
def test_activation_checkpointing_inside_and_around_a_unit(reentrant: bool, fsdp_outside: bool) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2))
    model = copy.deepcopy(ref)
    if fsdp_outside:
        model[1] = FSDP(_Checkpointed(model[1], reentrant), process_group=ONE)
    else:  # non-reentrant recomputation stops early by raising inside the unit's forward
        model[1] = _Checkpointed(FSDP(model[1], process_group=ONE), reentrant)
    fsdp = FSDP(model, process_group=ONE)
    x = torch.randn(3, 4, requires_grad=True)
    for m in (ref, fsdp):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            m(x).pow(2).sum().backward()
            opt.step()
    with fsdp.summon_full_params():
        got = {n.replace("1.m.", "1."): p for n, p in fsdp.named_parameters()}
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got[n], p)
    assert all(u.training_state == TrainingState.IDLE for u in fsdp.modules() if isinstance(u, FSDP))
