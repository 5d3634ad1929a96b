"""gpu-check parts on a ~1B-parameter transformer at world size 1: ``shardkit plan``'s accelerator estimate
against the allocator's real peak (DDP and FSDP), and throughput of the plain model, shardkit FSDP and torch
FSDP2 ``fully_shard`` (tokens/s and peak memory)."""

from __future__ import annotations

import functools
import gc
import time
from typing import Any, Callable

import torch
from torch import nn

from shardkit.bench.gpu_check.common import (
    CUDA,
    DEVICE,
    Results,
    batches,
    billion_lm,
    build_lm,
    init_world_of_one,
    sync,
    train,
)
from shardkit.models import TransformerLM, param_count

BATCH = 4


def _free() -> None:
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _real_peak(strategy: str, small: bool) -> dict[str, Any]:
    """Peak bytes the allocator saw over two AdamW steps of ``strategy`` (model built on the device first)."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.strategies.registry import OptimizerSpec, get_strategy

    cfg = billion_lm(small)
    _free()
    model, optimizer, _ = get_strategy(strategy).build(
        build_lm(cfg, DEVICE), OptimizerSpec(torch.optim.AdamW, {"lr": 1e-4}), torch.distributed.group.WORLD
    )
    train(model, optimizer, batches(cfg, 2, BATCH, seed=3))
    sync()
    peak = torch.cuda.max_memory_allocated() if CUDA else 0
    del model, optimizer
    _free()
    return {"real_peak_bytes": peak}


def _planned_peak(strategy: str, small: bool) -> dict[str, Any]:
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    import shardkit.plan

    cfg = billion_lm(small)
    x = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len))
    y = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len))
    est = shardkit.plan.estimate(
        lambda: TransformerLM(cfg),
        (x,),
        loss_fn=lambda logits, batch: TransformerLM.loss_fn(logits.float(), y.to(logits.device)),
        strategy=strategy,
        world_size=1,
        optimizer=torch.optim.AdamW,
        optimizer_options={"lr": 1e-4},
    )
    return {"planned_peak_bytes": est.peak_bytes, "planned_device": est.device, "peak_phase": est.peak_phase}


def part_plan(res: Results, small: bool) -> None:
    """Planned against real device peaks for DDP and FSDP (the plan runs first, before the process group)."""
    planned: dict[str, Any] = {}
    for strategy in ("ddp", "fsdp"):
        planned[strategy] = res.check(f"plan:{strategy}", functools.partial(_planned_peak, strategy, small))

    def backend() -> dict[str, Any]:
        with torch.device("meta"):
            params = param_count(TransformerLM(billion_lm(small)))
        return {"backend": init_world_of_one(), "params": params}

    res.check("backend", backend)
    for strategy in ("ddp", "fsdp"):

        def compare(strategy: str = strategy) -> dict[str, Any]:
            real = _real_peak(strategy, small)
            plan = planned.get(strategy) or {}
            out: dict[str, Any] = {**plan, **real}
            if plan and real["real_peak_bytes"]:
                out["planned_over_real"] = round(plan["planned_peak_bytes"] / real["real_peak_bytes"], 3)
            return out

        res.check(f"plan_vs_real:{strategy}", compare)


def _throughput(name: str, build: Callable[[nn.Module], nn.Module], small: bool) -> dict[str, Any]:
    cfg = billion_lm(small)
    _free()
    model = build(build_lm(cfg, DEVICE))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = batches(cfg, 2, BATCH, seed=7)
    train(model, optimizer, data, autocast=torch.bfloat16)  # warm-up (allocator, kernels)
    sync()
    steps = 2 if small else 6
    start = time.perf_counter()
    train(model, optimizer, [data[i % 2] for i in range(steps)], autocast=torch.bfloat16)
    sync()
    secs = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if CUDA else 0
    del model, optimizer
    _free()
    tokens = steps * BATCH * cfg.seq_len
    return {"tokens_per_s": round(tokens / secs, 1), "step_ms": round(1000 * secs / steps, 1), "peak_bytes": peak}


def _shardkit_fsdp(model: nn.Module) -> nn.Module:
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.bench.gpu_check.parts_fsdp import wrap_blocks

    return wrap_blocks(model)


def _torch_fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(DEVICE.type, (1,))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def part_throughput(res: Results, small: bool) -> None:
    """Tokens/s and peak memory of AdamW steps under bf16 autocast, batch 4 x 512 tokens, world size 1."""
    res.check("backend", lambda: {"backend": init_world_of_one()})
    for name, build in (("plain", lambda m: m), ("shardkit_fsdp", _shardkit_fsdp), ("torch_fsdp2", _torch_fsdp2)):
        res.check(f"throughput:{name}", lambda n=name, b=build: _throughput(n, b, small))  # type: ignore[misc]
