"""gpu-check parts on a ~1B-parameter transformer built on the GPU (its weights initialised there, nothing copied
from the host), at world size 1.

``throughput``: shardkit FSDP against torch FSDP2 ``fully_shard`` (and the plain model), AdamW under bf16 autocast,
20 timed steps each, interleaved in rounds of 4 so drift in clocks or temperature hits all alike, with no
synchronisation inside a round. Judged: shardkit's tokens/s over FSDP2's, and its model FLOPs against the card's
own measured bf16 matmul rate (MFU). At world size 1 shardkit skips its collectives while FSDP2 still issues
its gathers: the ratio is labelled world size 1, not a claim about many ranks.

``plan``: ``shardkit plan``'s device-memory estimate against the allocator's real peak, DDP and FSDP, within 10%.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from shardkit.bench.gpu_check.common import (
    CUDA,
    PartContext,
    batches,
    billion_lm,
    build_lm,
    device,
    sync,
    train,
    world_of_one,
)
from shardkit.bench.gpu_check.results import NotRun, Outcome, Results, at_least
from shardkit.models import LMConfig, TransformerLM, lm_flops_per_token, param_count

BATCH = 8
ROUNDS, STEPS_PER_ROUND = 5, 4
#: shardkit FSDP's tokens/s over torch FSDP2's, at world size 1, must be at least this.
RATIO_TO_FSDP2 = 0.9
#: Model FLOPs (3 x forward) per second over the card's measured bf16 matmul rate, at least.
MFU_FLOOR = 0.3
#: ``shardkit plan``'s peak over the allocator's real peak must lie within this fraction of 1.
PLAN_TOLERANCE = 0.10
MODELS = ("shardkit_fsdp", "torch_fsdp2", "plain")


def _free() -> None:
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def matmul_rate(small: bool) -> float:
    """This card's dense matmul rate in FLOP/s (bf16 on CUDA, fp32 on CPU), measured over 50 back-to-back runs."""
    n = 512 if small or not CUDA else 8192
    dtype = torch.bfloat16 if CUDA else torch.float32
    a, b = (torch.randn(n, n, device=device(), dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    sync()
    start = time.perf_counter()
    for _ in range(50):
        a @ b
    sync()
    return 50 * 2 * n**3 / (time.perf_counter() - start)


def _build(name: str, cfg: LMConfig) -> tuple[nn.Module, torch.optim.Optimizer]:
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.strategies.registry import OptimizerSpec, get_strategy

    model = build_lm(cfg, device())  # created on the GPU: nothing copied from the host
    if name == "plain":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    spec = OptimizerSpec(torch.optim.AdamW, {"lr": 1e-4})
    wrapped, optimizer, _ = get_strategy(name.replace("shardkit_", "")).build(model, spec, dist.group.WORLD)
    return wrapped, optimizer


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, data: list[Any], count: int) -> None:
    """``count`` AdamW steps under bf16 autocast (CUDA; none on CPU, where it is slow), nothing read back."""
    for i in range(count):
        x, y = data[i % len(data)]
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=CUDA):
            loss = TransformerLM.loss_fn(model(x).float(), y)
        loss.backward()
        optimizer.step()


def interleaved_throughput(small: bool) -> dict[str, Any]:
    """Tokens/s of each model over ``ROUNDS`` x ``STEPS_PER_ROUND`` timed steps, the models taking turns
    (2 x 2 with ``small``: the plumbing only)."""
    cfg = billion_lm(small)
    rounds, per_round = (2, 2) if small else (ROUNDS, STEPS_PER_ROUND)
    _free()
    built = {name: _build(name, cfg) for name in MODELS}
    data = batches(cfg, 2, BATCH, seed=7)
    for model, optimizer in built.values():
        _steps(model, optimizer, data, 2)  # warm-up: allocator, kernels, AdamW state
    secs = dict.fromkeys(MODELS, 0.0)
    for r in range(rounds):
        for name in MODELS[r % len(MODELS) :] + MODELS[: r % len(MODELS)]:  # each model leads a round in turn
            sync()
            start = time.perf_counter()
            _steps(*built[name], data, per_round)
            sync()
            secs[name] += time.perf_counter() - start
    tokens = rounds * per_round * BATCH * cfg.seq_len
    with torch.device("meta"):
        params = param_count(TransformerLM(cfg))
    return {
        "world_size": 1,
        "params": params,
        "timed_steps_each": rounds * per_round,
        "tokens_per_s": {name: round(tokens / s, 1) for name, s in secs.items()},
        "flops_per_token": 3 * lm_flops_per_token(cfg),
        "peak_bytes_all_three": torch.cuda.max_memory_allocated() if CUDA else 0,
    }


def part_throughput(res: Results, ctx: PartContext) -> None:
    """shardkit FSDP vs torch FSDP2 (and plain) on the ~1B model, interleaved; the ratio and MFU judged."""
    res.check("backend", world_of_one)
    found: dict[str, Any] = {}

    def rate() -> Outcome:
        found["rate"] = matmul_rate(ctx.small)
        return Outcome(found["rate"] > 0, round(found["rate"] / 1e12, 2), "TFLOP/s measured (> 0)")

    def timed() -> Outcome:
        found.update(interleaved_throughput(ctx.small))
        return Outcome(True, found, f"{ROUNDS} rounds of {STEPS_PER_ROUND} steps per model, world size 1")

    res.check("matmul_rate_tflops", rate)
    res.check("throughput:ws1_interleaved", timed)

    def ratio() -> Outcome:
        if not CUDA:
            raise NotRun("CPU timings of a toy model say nothing about a GPU")
        tps = found["tokens_per_s"]
        return at_least(tps["shardkit_fsdp"] / tps["torch_fsdp2"], RATIO_TO_FSDP2, "shardkit/FSDP2 tokens/s (ws 1)")

    def mfu() -> Outcome:
        if not CUDA:
            raise NotRun("CPU timings of a toy model say nothing about a GPU")
        used = found["tokens_per_s"]["shardkit_fsdp"] * found["flops_per_token"]
        return at_least(used / found["rate"], MFU_FLOOR, "shardkit FSDP model FLOP/s over the measured matmul rate")

    res.check("throughput:ratio_to_fsdp2_ws1", ratio)
    res.check("throughput:mfu_vs_measured_matmul", mfu)


def _real_peak(strategy: str, cfg: LMConfig) -> int:
    """Peak bytes the allocator saw over two AdamW steps of ``strategy`` (the model built on the device)."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.strategies.registry import OptimizerSpec, get_strategy

    _free()
    model, optimizer, _ = get_strategy(strategy).build(
        build_lm(cfg, device()), OptimizerSpec(torch.optim.AdamW, {"lr": 1e-4}), dist.group.WORLD
    )
    train(model, optimizer, batches(cfg, 2, BATCH // 2, seed=3))
    sync()
    peak = torch.cuda.max_memory_allocated()
    del model, optimizer
    _free()
    return peak


def _planned_peak(strategy: str, cfg: LMConfig) -> int:
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    import shardkit.plan

    x = torch.randint(0, cfg.vocab_size, (BATCH // 2, cfg.seq_len))
    y = torch.randint(0, cfg.vocab_size, (BATCH // 2, cfg.seq_len))
    est = shardkit.plan.estimate(
        lambda: TransformerLM(cfg),
        (x,),
        loss_fn=lambda logits, batch: TransformerLM.loss_fn(logits.float(), y.to(logits.device)),
        strategy=strategy,
        world_size=1,
        optimizer=torch.optim.AdamW,
        optimizer_options={"lr": 1e-4},
    )
    return int(est.peak_bytes)


def _plan_case(strategy: str, cfg: LMConfig, planned: dict[str, int]) -> Callable[[], Outcome]:
    def check() -> Outcome:
        if not CUDA:
            raise NotRun(f"no device allocator to compare with (plan said {planned[strategy]} bytes)")
        real = _real_peak(strategy, cfg)
        ratio = planned[strategy] / real
        ok = abs(ratio - 1) <= PLAN_TOLERANCE
        value = {"planned_bytes": planned[strategy], "real_peak_bytes": real, "planned_over_real": round(ratio, 3)}
        return Outcome(ok, value, f"within {PLAN_TOLERANCE:.0%} of 1", "" if ok else f"plan/real = {ratio:.3f}")

    return check


def part_plan(res: Results, ctx: PartContext) -> None:
    """Planned against real device peaks for DDP and FSDP (the plans run first, before the process group)."""
    cfg = billion_lm(ctx.small)
    planned: dict[str, int] = {}
    for strategy in ("ddp", "fsdp"):

        def plan(strategy: str = strategy) -> Outcome:
            planned[strategy] = _planned_peak(strategy, cfg)
            return Outcome(planned[strategy] > 0, planned[strategy], "a positive number of bytes")

        res.check(f"plan:{strategy}", plan)
    res.check("backend", world_of_one)
    for strategy in ("ddp", "fsdp"):
        if strategy in planned:
            res.check(f"plan_vs_real:{strategy}", _plan_case(strategy, cfg, planned))
        else:
            res.check(f"plan_vs_real:{strategy}", lambda: Outcome(False, None, "a plan", "the plan above failed"))
