"""gpu-check parts ``env`` (versions, every module imported, private torch APIs), ``strategies`` (every registered
strategy, smp and SlowMo at world size 1 against the plain model, deterministic kernels on) and ``cuda_tests``
(the suite's CUDA-only tests, when pytest is there)."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from shardkit.bench.gpu_check.common import (
    CUDA,
    PartContext,
    batches,
    build_lm,
    deterministic,
    device,
    host_params,
    loss_gap,
    max_diff,
    small_lm,
    train,
    world_of_one,
)
from shardkit.bench.gpu_check.results import NotRun, Outcome, Results, all_true, at_most

#: Packages of pyproject's extras (and the test runner): a module needing one that is absent is not a failure.
OPTIONAL_PACKAGES = frozenset({"lightning", "pytorch_lightning", "transformers", "matplotlib", "pytest", "accelerate"})
#: Largest loss or parameter difference a strategy at world size 1 may show against the plain model (fp32).
WS1_TOLERANCE = 1e-4


def part_env(res: Results, ctx: PartContext) -> None:
    """Versions, the device, every shardkit module imported, which private torch APIs this torch has."""

    def versions() -> Outcome:
        facts = {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cuda_available": CUDA,
            "gpu": torch.cuda.get_device_name(0) if CUDA else None,
            "gpu_count": torch.cuda.device_count() if CUDA else 0,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if CUDA else None,
            "nccl_available": dist.is_nccl_available(),
            "gloo_available": dist.is_gloo_available(),
            "device_chosen": str(device()),
        }
        return Outcome(bool(facts["gloo_available"]), facts, "gloo available (NCCL too, on CUDA)")

    res.check("versions", versions)
    if CUDA:
        res.check("nccl_available", lambda: Outcome(dist.is_nccl_available(), dist.is_nccl_available(), True))

    def import_all() -> Outcome:
        # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
        import shardkit

        failed, optional = {}, {}
        names = [m.name for m in pkgutil.walk_packages(shardkit.__path__, "shardkit.", onerror=lambda name: None)]
        for name in names:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as err:
                if (err.name or "").split(".")[0] in OPTIONAL_PACKAGES:
                    optional[name] = f"needs {err.name} (an optional dependency)"
                else:
                    failed[name] = f"{type(err).__name__}: {err}"[:300]
            except Exception as err:  # every module's failure is reported, not just the first
                failed[name] = f"{type(err).__name__}: {err}"[:300]
        value = {"modules": len(names), "failed": failed, "optional_missing": optional}
        return Outcome(not failed, value, "every module imports, but for optional dependencies not installed")

    if ctx.small:
        res.not_run("import_every_module", "--small/--dry-run: ~15 s on a busy CPU, and the suite imports them all")
    else:
        res.check("import_every_module", import_all)

    def private_apis() -> Outcome:
        # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
        from shardkit.utils import torch_compat

        missing = torch_compat.missing()
        value = {"missing": missing, "checked": len(torch_compat.PRIVATE_APIS)}
        return Outcome(not missing, value, "every private torch API shardkit uses is found")

    res.check("private_torch_apis", private_apis)


def _parity(
    name: str,
    losses: list[float],
    ref_losses: list[float],
    model: nn.Module,
    ref: nn.Module,
    nondeterministic: list[str],
) -> Outcome:
    gap = max(loss_gap(losses, ref_losses), max_diff(host_params(model), host_params(ref)))
    outcome = at_most(gap, WS1_TOLERANCE, f"{name}: largest loss/parameter gap to the plain model")
    value = {"gap": gap, "losses": losses, "nondeterministic_ops": nondeterministic}
    return Outcome(outcome.ok, value, outcome.threshold, outcome.why)


def _strategy_run(name: str, small: bool) -> Outcome:
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.strategies.registry import OptimizerSpec, get_strategy

    strategy = get_strategy(name)
    reason = strategy.unavailable_reason()
    if reason is not None:
        raise NotRun(f"unavailable here: {reason}")
    cfg = small_lm(small)
    data = batches(cfg, 3, 4, seed=10)
    spec = OptimizerSpec(torch.optim.AdamW, {"lr": 1e-3})
    with deterministic() as nondeterministic:
        ref = build_lm(cfg, device())
        ref_losses = train(ref, spec.make(ref.parameters()), data)
        model, optimizer, after_step = strategy.build(build_lm(cfg, device()), spec, dist.group.WORLD)
        losses = train(model, optimizer, data, after_step=after_step)
    return _parity(name, losses, ref_losses, model, ref, nondeterministic)


def _smp_run(small: bool) -> Outcome:
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    import shardkit.modelparallel as smp
    from shardkit.models import TransformerLM

    cfg = small_lm(small)
    data = batches(cfg, 3, 4, seed=10)
    with deterministic() as nondeterministic:
        ref = build_lm(cfg).to(device())  # drawn on the host as smp's model is (a GPU draws other numbers)
        ref_losses = train(ref, torch.optim.SGD(ref.parameters(), lr=0.05), data)
        smp.init({"partitions": 1, "microbatches": 2})
        try:
            model = smp.DistributedModel(build_lm(cfg))  # built on the host: smp places it on its device

            @smp.step
            def step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                loss = TransformerLM.loss_fn(model(x), y)
                model.backward(loss)
                return loss

            optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
            losses = []
            for x, y in data:
                optimizer.zero_grad()
                losses.append(float(step(model, x, y).reduce_mean()))
                optimizer.step()
            placed = str(next(model.parameters()).device)
            outcome = _parity("smp", losses, ref_losses, model, ref, nondeterministic)
        finally:
            smp.reset()
    if placed != str(device()):
        return Outcome(False, placed, str(device()), f"smp placed the model on {placed}")
    return outcome


def slow_momentum_reference(model: nn.Module, lr: float, frequency: int, beta: float) -> Callable[[], None]:
    """SlowMo's outer step written out for one rank (Wang et al.: ``u = beta*u + (x0 - x)/lr``,
    ``x0 -= lr*u``, ``x = x0`` every ``frequency`` steps); call after each optimizer step."""
    params = list(model.parameters())
    anchor = [p.detach().clone() for p in params]
    momentum = [torch.zeros_like(p) for p in params]
    count = [0]

    def after_step() -> None:
        count[0] += 1
        if count[0] % frequency:
            return
        with torch.no_grad():
            for p, x0, u in zip(params, anchor, momentum):
                u.mul_(beta).add_((x0 - p) / lr)
                x0.sub_(lr * u)
                p.copy_(x0)

    return after_step


def _slowmo_run(small: bool) -> Outcome:
    """SlowMo's step (``perform_slowmo`` after each optimizer step) against the outer step written out."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.nn.slowmo import SlowMoDistributedDataParallel

    cfg, lr, frequency, beta = small_lm(small), 0.05, 2, 0.5
    data = batches(cfg, 4, 4, seed=10)
    with deterministic() as nondeterministic:
        plain = build_lm(cfg, device())
        train(plain, torch.optim.SGD(plain.parameters(), lr=lr), data)
        ref = build_lm(cfg, device())
        ref_losses = train(
            ref,
            torch.optim.SGD(ref.parameters(), lr=lr),
            data,
            after_step=slow_momentum_reference(ref, lr, frequency, beta),
        )
        model = SlowMoDistributedDataParallel(
            build_lm(cfg, device()),
            nprocs_per_node=1,
            slowmo_frequency=frequency,
            slowmo_momentum=beta,
            localsgd_frequency=1,
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        losses = train(model, optimizer, data, after_step=lambda: model.perform_slowmo(optimizer))
    parity = _parity("slowmo", losses, ref_losses, model, ref, nondeterministic)
    moved = max_diff(host_params(model), host_params(plain))
    facts = {"matches_reference": parity.ok, "slow_step_changed_the_weights": moved > 10 * WS1_TOLERANCE}
    outcome = all_true(facts, f"gap to the written-out outer step <= {WS1_TOLERANCE}; differs from plain SGD")
    return Outcome(outcome.ok, {**facts, **parity.value, "gap_to_plain_sgd": moved}, outcome.threshold, outcome.why)


def part_strategies(res: Results, ctx: PartContext) -> None:
    """Every registered strategy, smp and SlowMo at world size 1 (NCCL on CUDA), against the plain model."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.strategies.registry import all_strategies

    res.check("backend", world_of_one)
    for strategy in all_strategies():
        if strategy.name == "slowmo":
            continue  # its own check below calls its slow step against a written-out reference
        res.check(f"ws1:{strategy.name}", lambda n=strategy.name: _strategy_run(n, ctx.small))  # type: ignore[misc]
    res.check("ws1:smp", lambda: _smp_run(ctx.small))
    res.check("ws1:slowmo_step", lambda: _slowmo_run(ctx.small))


#: The tests the suite skips without CUDA (the rest of the suite runs on CPU everywhere already).
CUDA_ONLY_TESTS = (
    "tests/nn/wrap/test_wrap_fairscale_compat.py::test_move_module_cuda_half_moves_before_wrapping",
    "tests/nn/checkpoint/test_ckpt_wrapper.py::test_offload_to_cpu_keeps_saved_inputs_on_host",
    "tests/modelparallel/test_smp_trace_options.py::test_trace_device_moves_the_trace_and_leaves_the_model",
)


def part_cuda_tests(res: Results, ctx: PartContext) -> None:
    """The suite's CUDA-only tests under pytest, when this machine has pytest and the checkout's tests."""
    repo = Path(__file__).resolve().parents[4]

    def run() -> Outcome:
        if not CUDA:
            raise NotRun("they are skipped without CUDA")
        if importlib.util.find_spec("pytest") is None:
            raise NotRun("pytest is not installed here (no package index on the lent machine)")
        tests = [t for t in CUDA_ONLY_TESTS if (repo / t.split("::")[0]).exists()]
        if not tests:
            raise NotRun(f"no tests folder beside {repo / 'src'}")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rs", *tests]
        proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=max(5.0, ctx.left() - 2))
        tail = (proc.stdout + proc.stderr)[-3000:]
        skipped = "skipped" in proc.stdout.splitlines()[-1] if proc.stdout.strip() else False
        ok = proc.returncode == 0 and not skipped
        return Outcome(ok, {"rc": proc.returncode, "tests": tests, "tail": tail}, "all pass, none skipped")

    res.check("pytest_cuda_only_tests", run)
