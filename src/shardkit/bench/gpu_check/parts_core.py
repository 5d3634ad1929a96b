"""gpu-check parts: the environment, the CUDA-only tests, every strategy at world size 1, two ranks on one GPU."""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardkit.bench.gpu_check.common import (
    CUDA,
    DEVICE,
    Results,
    batches,
    build_lm,
    host_params,
    init_world_of_one,
    loss_gap,
    max_diff,
    small_lm,
    train,
)

#: The tests that only run, or only mean something, with CUDA: skipped on CPU, or CPU tests of CUDA rules.
CUDA_TESTS = (
    "tests/nn/wrap/test_wrap_fairscale_compat.py::test_move_module_cuda_half_moves_before_wrapping",
    "tests/nn/checkpoint/test_ckpt_wrapper.py::test_offload_to_cpu_keeps_saved_inputs_on_host",
    "tests/modelparallel/test_smp_trace_options.py::test_trace_device_moves_the_trace_and_leaves_the_model",
    "tests/nn/fsdp/test_fsdp_perf_lean.py::test_cpu_offload_keeps_state_on_cpu_and_matches",
    "tests/nn/fsdp/test_fsdp_offload_device.py",
    "tests/distributed/test_device.py",
    "tests/reliability/test_rel_universal_stage_copies.py",
    "tests/modelparallel/test_smp_p2p_blocking.py",
)


def part_env(res: Results, small: bool) -> None:
    """Versions, the device, every shardkit module imported, which collective names this torch has."""
    res.check("versions", lambda: {
        "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": CUDA, "gpu": torch.cuda.get_device_name(0) if CUDA else None,
        "gpu_count": torch.cuda.device_count() if CUDA else 0,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if CUDA else None,
        "nccl_available": dist.is_nccl_available(), "gloo_available": dist.is_gloo_available(),
    })  # fmt: skip

    def import_all() -> dict[str, Any]:
        # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
        import shardkit

        failed = {}
        names = [m.name for m in pkgutil.walk_packages(shardkit.__path__, "shardkit.")]
        for name in names:
            try:
                importlib.import_module(name)
            except Exception as err:  # every module's failure is reported, not just the first
                failed[name] = f"{type(err).__name__}: {err}"[:300]
        return {"ok": not failed, "modules": len(names), "failed": failed}

    if not small:  # ~15 s on a busy CPU: the dry run and --small skip it
        res.check("import_every_module", import_all)

    def private_apis() -> dict[str, Any]:
        # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
        from shardkit.utils import torch_compat

        missing = torch_compat.missing()
        return {"ok": not missing, "missing": missing, "checked": len(torch_compat.PRIVATE_APIS)}

    res.check("private_torch_apis", private_apis)


def part_cuda_tests(res: Results, small: bool, repo: Path) -> None:
    """The CUDA-only tests under pytest (when the machine has pytest; see ``make gpu-check-wheels``)."""

    def run() -> dict[str, Any]:
        try:
            import pytest  # noqa: F401
        except ImportError:
            return {"ok": False, "skipped": "pytest is not installed here: carry tools/gpu_check/wheels"}
        existing = [t for t in CUDA_TESTS if (repo / t.split("::")[0]).exists()]
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *existing]
        proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=150 if not small else 300)
        tail = (proc.stdout + proc.stderr)[-3000:]
        return {"ok": proc.returncode == 0, "rc": proc.returncode, "tests": existing, "tail": tail}

    res.check("pytest_cuda_tests", run)


def _strategy_run(name: str, small: bool) -> dict[str, Any]:
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.strategies.registry import OptimizerSpec, get_strategy

    cfg = small_lm(small)
    data = batches(cfg, 3, 4, seed=10)
    spec = OptimizerSpec(torch.optim.AdamW, {"lr": 1e-3})
    ref = build_lm(cfg, DEVICE)
    ref_losses = train(ref, spec.make(ref.parameters()), data)
    strategy = get_strategy(name)
    reason = strategy.unavailable_reason()
    if reason is not None:
        return {"ok": True, "skipped": reason}
    model, optimizer, _ = strategy.build(build_lm(cfg, DEVICE), spec, dist.group.WORLD)
    losses = train(model, optimizer, data)
    gap, params = loss_gap(losses, ref_losses), max_diff(host_params(model), host_params(ref))
    return {"ok": gap < 1e-4 and params < 1e-4, "loss_gap": gap, "param_gap": params, "losses": losses}


def _smp_run(small: bool) -> dict[str, Any]:
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    import shardkit.modelparallel as smp
    from shardkit.models import TransformerLM

    cfg = small_lm(small)
    data = batches(cfg, 3, 4, seed=10)
    ref = build_lm(cfg, DEVICE)
    ref_losses = train(ref, torch.optim.SGD(ref.parameters(), lr=0.05), data)
    smp.init({"partitions": 1, "microbatches": 2})
    try:
        model = smp.DistributedModel(build_lm(cfg, DEVICE))
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))

        @smp.step
        def step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = TransformerLM.loss_fn(model(x), y)
            model.backward(loss)
            return loss

        losses = []
        for x, y in data:
            optimizer.zero_grad()
            losses.append(float(step(model, x, y).reduce_mean()))
            optimizer.step()
        gap = loss_gap(losses, ref_losses)
        return {"ok": gap < 1e-4, "loss_gap": gap, "param_device": str(next(model.parameters()).device)}
    finally:
        smp.reset()


def _slowmo_run(small: bool) -> dict[str, Any]:
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.nn.slowmo import SlowMoDistributedDataParallel

    cfg = small_lm(small)
    data = batches(cfg, 3, 4, seed=10)
    ref = build_lm(cfg, DEVICE)
    ref_losses = train(ref, torch.optim.SGD(ref.parameters(), lr=0.05), data)
    model = SlowMoDistributedDataParallel(build_lm(cfg, DEVICE), nprocs_per_node=1, localsgd_frequency=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = train(model, optimizer, data, after_backward=lambda: None)
    return {
        "ok": True,
        "loss_gap_without_slowmo_step": loss_gap(losses, ref_losses),
        "comm_device": str(model.comm_device),
    }


def part_strategies(res: Results, small: bool) -> None:
    """Every registered strategy, smp and SlowMo at world size 1 on NCCL, against the unwrapped model."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.strategies.registry import all_strategies

    res.check("backend", lambda: {"backend": init_world_of_one()})
    for strategy in all_strategies():
        res.check(f"ws1:{strategy.name}", lambda n=strategy.name: _strategy_run(n, small))  # type: ignore[misc]
    res.check("ws1:smp", lambda: _smp_run(small))
    res.check("ws1:slowmo", lambda: _slowmo_run(small))


def _gloo_cuda_worker(rank: int, world_size: int, small: bool) -> dict[str, Any]:
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.distributed import groups
    from shardkit.strategies.registry import OptimizerSpec, get_strategy

    if CUDA:
        torch.cuda.set_device(0)  # one GPU for both ranks: only gloo allows that
    found: dict[str, Any] = {}

    def attempt(name: str, fn: Any) -> None:
        try:
            found[name] = bool(fn())
        except Exception as err:  # which collectives gloo refuses with CUDA tensors is the finding
            found[name] = f"{type(err).__name__}: {str(err)[:200]}"

    def all_reduce() -> bool:
        t = torch.full((64,), float(rank + 1), device=DEVICE)
        dist.all_reduce(t)
        return bool((t == 3).all())

    def broadcast() -> bool:
        t = torch.full((64,), float(rank), device=DEVICE)
        dist.broadcast(t, src=1)
        return bool((t == 1).all())

    def all_gather() -> bool:
        out = torch.empty(8, device=DEVICE)
        groups.all_gather_flat(out, torch.full((4,), float(rank), device=DEVICE))
        return bool(torch.equal(out.cpu(), torch.tensor([0.0] * 4 + [1.0] * 4)))

    def reduce_scatter() -> bool:
        out = torch.empty(4, device=DEVICE)
        groups.reduce_scatter_flat(out, torch.arange(8.0, device=DEVICE))
        return bool(torch.equal(out.cpu(), 2 * torch.arange(4.0) + 8 * rank))

    for name, fn in (("all_reduce", all_reduce), ("broadcast", broadcast), ("all_gather_flat", all_gather),
                     ("reduce_scatter_flat", reduce_scatter)):  # fmt: skip
        attempt(name, fn)
    cfg = small_lm(True)
    data = batches(cfg, 2, 4, seed=100 + rank)
    for name in ("fsdp", "oss_sdp"):
        try:
            spec = OptimizerSpec(torch.optim.SGD, {"lr": 0.05})
            model, optimizer, _ = get_strategy(name).build(build_lm(cfg, DEVICE), spec, dist.group.WORLD)
            losses = train(model, optimizer, data)
            found[f"train:{name}"] = {"losses": losses, "params": host_params(model)}
        except Exception as err:
            found[f"train:{name}"] = f"{type(err).__name__}: {str(err)[:300]}"
    return found


def part_gloo_ranks(res: Results, small: bool) -> None:
    """Two ranks on the one GPU over gloo with CUDA tensors: the collectives gloo takes, and FSDP / ZeRO-2 trained
    on both against one process on both ranks' batches. Untested here: NCCL with several ranks (its collectives,
    the pipeline's batched sends), and gloo send/recv with CUDA tensors (gloo has none; shardkit stages them)."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.testing import run_distributed

    def run() -> dict[str, Any]:
        outs = run_distributed(_gloo_cuda_worker, 2, small, timeout_s=120)
        cfg = small_lm(True)
        data = [b for pair in zip(batches(cfg, 2, 4, seed=100), batches(cfg, 2, 4, seed=101)) for b in pair]
        ref = build_lm(cfg, DEVICE)
        full = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(data[::2], data[1::2])]
        train(ref, torch.optim.SGD(ref.parameters(), lr=0.05), full)
        summary: dict[str, Any] = {k: v for k, v in outs[0].items() if not k.startswith("train:")}
        ok = all(v is True for v in summary.values())
        for name in ("fsdp", "oss_sdp"):
            got = outs[0][f"train:{name}"]
            if isinstance(got, str):
                summary[name], ok = got, False
                continue
            gap = max_diff(got["params"], host_params(ref))
            summary[name] = {"param_gap_vs_one_process": gap}
            ok = ok and gap < 1e-4
        return {"ok": ok, **summary}

    res.check("gloo_two_ranks_one_gpu", run)


def repo_root() -> Path:
    """The checkout this package runs from (tests live beside ``src``)."""
    return Path(os.environ.get("SHARDKIT_REPO", Path(__file__).resolve().parents[4]))
