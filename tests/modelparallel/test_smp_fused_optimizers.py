"""smp.optimizers.FusedNovoGrad and FusedLamb against per-parameter references of the published rules.

The references below update one tensor at a time with ordinary torch arithmetic, following the papers
(NovoGrad: Ginsburg et al. 2019, a per-layer second moment of the gradient norm; LAMB: You et al. 2019, the
trust ratio ||w|| / ||update||) with Apex's options (bias correction, gradient averaging, decoupled or L2
weight decay, global-norm clipping) spelled out.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch
from torch import nn

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed

STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    return ((model(x) - y) ** 2).mean() * 4.0


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two groups with their own lr and weight decay."""
    first, second = model[0], model[2]
    return [
        {"params": list(first.parameters()), "lr": 0.05, "weight_decay": 0.1},
        {"params": list(second.parameters()), "lr": 0.02, "weight_decay": 0.0},
    ]


def _novograd_reference(opts: dict[str, Any]) -> Callable[[list[dict[str, Any]], dict[int, dict[str, Any]]], None]:
    b1, b2 = opts.get("betas", (0.9, 0.999))
    eps = opts.get("eps", 1e-8)
    inside = opts.get("reg_inside_moment", False)
    averaging = opts.get("grad_averaging", True)
    correct = opts.get("bias_correction", True)
    inf_norm = opts.get("norm_type", 2) == 0
    init_zero = opts.get("init_zero", False)

    def step(groups: list[dict[str, Any]], state: dict[int, dict[str, Any]]) -> None:
        for group in groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                g = p.grad.double()
                w = p.detach().double()
                norm = g.abs().max().item() if inf_norm else math.sqrt((g * g).sum().item())
                s = state.setdefault(id(p), {"t": 0, "m": torch.zeros_like(w), "n": 0.0 if init_zero else norm})
                s["t"] += 1
                t = s["t"]
                if inf_norm:
                    s["n"] = b2 * s["n"] + (1 - b2) * norm
                else:
                    s["n"] = math.sqrt(b2 * s["n"] ** 2 + (1 - b2) * norm**2)
                d = s["n"] / (math.sqrt(1 - b2**t) if correct else 1.0) + eps
                c1 = 1 - b1**t if correct else 1.0
                b3 = 1 - b1 if averaging else 1.0
                if inside:
                    s["m"] = b1 * s["m"] + b3 * (g / d + wd * w)
                    new = w - lr * s["m"] / c1
                else:
                    s["m"] = b1 * s["m"] + b3 * g
                    new = w - lr * (s["m"] / c1 / d + wd * w)
                with torch.no_grad():
                    p.copy_(new)

    return step


def _lamb_reference(opts: dict[str, Any]) -> Callable[[list[dict[str, Any]], dict[int, dict[str, Any]]], None]:
    b1, b2 = opts.get("betas", (0.9, 0.999))
    eps = opts.get("eps", 1e-6)
    adam_w = opts.get("adam_w_mode", True)
    averaging = opts.get("grad_averaging", True)
    correct = opts.get("bias_correction", True)
    max_norm = opts.get("max_grad_norm", 1.0)
    nvlamb = opts.get("use_nvlamb", False)

    def step(groups: list[dict[str, Any]], state: dict[int, dict[str, Any]]) -> None:
        total = math.sqrt(sum((p.grad.double() ** 2).sum().item() for gr in groups for p in gr["params"]))
        clip = total / max_norm if max_norm > 0 and total > max_norm else 1.0
        for group in groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                w = p.detach().double()
                g = p.grad.double() / clip
                if not adam_w:
                    g = g + wd * w
                s = state.setdefault(id(p), {"t": 0, "m": torch.zeros_like(w), "v": torch.zeros_like(w)})
                s["t"] += 1
                t = s["t"]
                b3 = 1 - b1 if averaging else 1.0
                s["m"] = b1 * s["m"] + b3 * g
                s["v"] = b2 * s["v"] + (1 - b2) * g * g
                c1, c2 = (1 - b1**t, 1 - b2**t) if correct else (1.0, 1.0)
                update = (s["m"] / c1) / (torch.sqrt(s["v"] / c2) + eps)
                if adam_w:
                    update = update + wd * w
                ratio = 1.0
                if nvlamb or wd != 0:
                    wn, un = w.norm().item(), update.norm().item()
                    ratio = wn / un if wn > 0 and un > 0 else 1.0
                with torch.no_grad():
                    p.copy_(w - lr * ratio * update)

    return step


NOVOGRAD_CASES = [
    {},
    {"reg_inside_moment": True, "grad_averaging": False, "bias_correction": False},  # the paper's algorithm
    {"norm_type": 0, "init_zero": True, "betas": (0.8, 0.9)},
]
LAMB_CASES = [
    {},
    {"adam_w_mode": False, "grad_averaging": False, "max_grad_norm": 0.0},
    {"use_nvlamb": True, "bias_correction": False, "max_grad_norm": 0.5, "betas": (0.8, 0.95)},
]


def _compare(make: Callable[..., torch.optim.Optimizer], reference: Callable[..., None], opts: dict[str, Any]) -> None:
    ours_model, ref_model = _model(), _model()
    ours = make(_groups(ours_model), **opts)
    ref_groups, ref_state = _groups(ref_model), {}
    for step in range(STEPS):
        for model in (ours_model, ref_model):
            model.zero_grad(set_to_none=True)
            _loss(model, step).backward()
        ours.step()
        reference(ref_groups, ref_state)
        for (name, a), b in zip(ours_model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=lambda m, n=name, s=step: f"{n} step {s}: {m}")
    assert any(not torch.equal(a, b) for a, b in zip(ours_model.parameters(), _model().parameters()))


@pytest.mark.parametrize("opts", NOVOGRAD_CASES)
def test_novograd_matches_the_reference(opts: dict[str, Any]) -> None:
    _compare(smp.optimizers.FusedNovoGrad, _novograd_reference(opts), opts)


@pytest.mark.parametrize("opts", LAMB_CASES)
def test_lamb_matches_the_reference(opts: dict[str, Any]) -> None:
    _compare(smp.optimizers.FusedLamb, _lamb_reference(opts), opts)


def test_lamb_clipping_is_global() -> None:
    """With a tiny max_grad_norm every gradient is divided by the same global factor (the reference's)."""
    opts = {"max_grad_norm": 1e-3, "weight_decay": 0.0}
    _compare(smp.optimizers.FusedLamb, _lamb_reference(opts), opts)


@pytest.mark.parametrize("make", [smp.optimizers.FusedNovoGrad, smp.optimizers.FusedLamb])
def test_state_dict_round_trip_continues_identically(make: Callable[..., torch.optim.Optimizer]) -> None:
    straight_model = _model()
    straight = make(_groups(straight_model))
    resumed_model = _model()
    first = make(_groups(resumed_model))
    for step in range(STEPS):
        if step == 2:  # save, rebuild from scratch, load, continue
            saved = torch.load(_roundtrip(first.state_dict()), weights_only=False)
            kept = {k: v.clone() for k, v in resumed_model.state_dict().items()}
            resumed_model = _model()
            resumed_model.load_state_dict(kept)
            first = make(_groups(resumed_model))
            first.load_state_dict(saved)
        for model, opt in ((straight_model, straight), (resumed_model, first)):
            opt.zero_grad()
            _loss(model, step).backward()
            opt.step()
    for a, b in zip(straight_model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    state = first.state_dict()["state"]
    assert sorted(state) == list(range(4)) and all(float(s["step"]) == STEPS for s in state.values())


def _roundtrip(obj: Any) -> Any:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def test_zero_grad_low_precision_and_errors() -> None:
    model = _model()
    lamb = smp.optimizers.FusedLamb(model.parameters(), set_grad_none=False)
    _loss(model, 0).backward()
    lamb.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    lamb.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    lamb.step()  # no gradients: nothing moves, nothing fails
    # bf16 parameters are updated in fp32 maths: close to the fp32 run.
    half, full = _model().to(torch.bfloat16), _model()
    for model in (half, full):
        opt = smp.optimizers.FusedNovoGrad(model.parameters(), lr=0.05)
        for step in range(3):
            opt.zero_grad()
            _loss(model, step).float().backward() if model is full else _loss_bf16(model, step).backward()
            opt.step()
    for a, b in zip(half.parameters(), full.parameters()):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b, atol=3e-2, rtol=3e-2)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        smp.optimizers.FusedLamb(model.parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="norm_type must be 2"):
        smp.optimizers.FusedNovoGrad(model.parameters(), norm_type=1)
    with pytest.raises(ValueError, match=r"betas\[1\] must be in \[0, 1\)"):
        smp.optimizers.FusedNovoGrad(model.parameters(), betas=(0.9, 1.0))


def _loss_bf16(model: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    return ((model(x.bfloat16()).float() - y) ** 2).mean() * 4.0


# ---- under smp.DistributedOptimizer ---------------------------------------------------------------------------


def _make(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "lamb":
        return smp.optimizers.FusedLamb(params, lr=0.02, weight_decay=0.01, max_grad_norm=0.05)
    return smp.optimizers.FusedNovoGrad(params, lr=0.02, weight_decay=0.01)


def _single_process(kind: str, name: str, steps: int) -> tuple[dict[str, torch.Tensor], list[float], Any]:
    from smp_testlib import BUILDERS, batch, loss_of

    model = BUILDERS[name]()
    opt = _make(kind, model.parameters())
    norms = []
    for step in range(steps):
        x, y = batch(name, 8, 100 * step)
        opt.zero_grad()
        loss_of(name, model(x), y).backward()
        opt.step()
        norms.append(float(opt.last_grad_norm) if isinstance(opt, smp.optimizers.FusedLamb) else 0.0)
    return model.state_dict(), norms, opt.state_dict()


def _pipelined(
    rank: int, world_size: int, kind: str, name: str, steps: int, pipeline: str = "interleaved", microbatches: int = 2
) -> dict[str, Any]:
    from smp_testlib import BUILDERS, batch, train_step

    smp.init({"partitions": 2, "microbatches": microbatches, "pipeline": pipeline})
    model = smp.DistributedModel(BUILDERS[name]())
    opt = smp.DistributedOptimizer(_make(kind, model.parameters()))
    norms = []
    for step in range(steps):
        x, y = batch(name, 8, 100 * step)
        opt.zero_grad()
        train_step(model, name, x, y)
        opt.step()
        inner = opt.optimizer
        norms.append(float(inner.last_grad_norm) if isinstance(inner, smp.optimizers.FusedLamb) else 0.0)
    result = {"state": model.state_dict(), "norms": norms, "optimizer": opt.state_dict()}
    smp.reset()
    return result


@pytest.mark.parametrize(
    "kind,pipeline",
    [("lamb", "interleaved"), ("novograd", "interleaved"), ("lamb", "zero_bubble"), ("lamb", "zero_bubble_h2")],
)
def test_pipelined_training_matches_single_process(kind: str, pipeline: str) -> None:
    """Two stages, the residual model (one parameter replicated on both stages): the same steps as one
    process, and for LAMB the same global gradient norm (the replicated parameter counted once); under the
    zero-bubble schedule the norm is taken after every W, before the step."""
    steps = 3
    ref_state, ref_norms, ref_opt = _single_process(kind, "residual", steps)
    for out in run_distributed(_pipelined, 2, kind, "residual", steps, pipeline):
        for key, value in ref_state.items():
            torch.testing.assert_close(out["state"][key], value, atol=2e-5, rtol=1e-4)
        assert out["norms"] == pytest.approx(ref_norms, rel=1e-5)
        assert out["optimizer"]["state"].keys() == ref_opt["state"].keys()
        for index, state in ref_opt["state"].items():
            for field, value in state.items():
                torch.testing.assert_close(out["optimizer"]["state"][index][field], value, atol=2e-5, rtol=1e-4)
    if kind == "lamb":
        assert all(norm > 0.05 for norm in ref_norms)  # clipping was active at every step


@pytest.mark.parametrize("pipeline", ["zbv", "dualpipev"])
def test_v_schedules_clip_by_the_global_norm_after_every_w(pipeline: str) -> None:
    """Two chunks per rank in a V (backwards split into B and W, some run whole): FusedLamb's clipped steps and its
    global gradient norm over both ranks' chunks equal one process's, so no W was left out of the norm."""
    steps = 3
    ref_state, ref_norms, _ = _single_process("lamb", "mlp", steps)
    assert all(norm > 0.05 for norm in ref_norms)  # clipping was active at every step
    for out in run_distributed(_pipelined, 2, "lamb", "mlp", steps, pipeline, 4):
        for key, value in ref_state.items():
            torch.testing.assert_close(out["state"][key], value, atol=2e-5, rtol=1e-4)
        assert out["norms"] == pytest.approx(ref_norms, rel=1e-5)
