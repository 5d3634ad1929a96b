"""gpu-check part ``pipeline``: every smp schedule over two ranks, in the form this machine allows.

What it shows: the split backward of the zero-bubble schedules (B and W from one saved graph) runs where autograd
executes nodes on its CUDA device threads, and every schedule (1F1B, GPipe, ZB-H1, ZB-H2, ZBV, DualPipeV,
interleaved over virtual stages) trains the tied-weight LM as one process does. Per schedule and rank it records
the median step, the bubble smp measured (time blocked on receives / step) against the schedule's theory
(:func:`shardkit.bench.pipeline_theory.bubble_theory`, equal F/B/W) and the memory a step allocates above what is
resident. On two GPUs the ranks talk NCCL (``batch_isend_irecv``) and the bubble is judged; on one GPU they share
it over gloo, so the times and bubbles mean nothing and are only recorded (the NCCL path is then not run).
"""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from shardkit.bench.gpu_check.common import CUDA, PartContext, batches, build_lm, device, loss_gap, sync, train
from shardkit.bench.gpu_check.results import Outcome, Results, all_true
from shardkit.models import LMConfig, TransformerLM

MICROBATCHES = 8
BATCH = 16
STEPS = 3
LOSS_TOLERANCE = 1e-4
#: The measured bubble may be this multiple of the theory plus :data:`BUBBLE_PLUS`: the theory assumes equal F, B
#: and W times and free sends; a step of a few milliseconds on an H200 pays launch and NCCL latency on top.
BUBBLE_SLACK = 1.5
BUBBLE_PLUS = 0.08


def _config(small: bool) -> LMConfig:
    # Four blocks at least: ZBV and two virtual stages cut the model into four chunks.
    if small:
        return LMConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=4, seq_len=16)
    return LMConfig(vocab_size=8192, d_model=1024, n_heads=16, n_layers=8, seq_len=256)


def _settings() -> list[tuple[str, dict[str, Any]]]:
    """(label, smp config entries) of every schedule the installed shardkit offers."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.modelparallel.config import PIPELINES

    settings = [(name, {"pipeline": name}) for name in PIPELINES]
    return settings + [("interleaved_virtual2", {"pipeline": "interleaved", "virtual_stages": 2})]


def _schedule_run(cfg: LMConfig, entries: dict[str, Any], world_size: int) -> dict[str, Any]:
    """One schedule's losses, median step time, measured bubble and step memory on this rank."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    import shardkit.modelparallel as smp

    data = batches(cfg, STEPS + 1, BATCH, seed=300)

    @smp.step
    def train_step(model: Any, tokens: torch.Tensor, targets: torch.Tensor) -> Any:
        loss = TransformerLM.loss_fn(model(tokens), targets)
        model.backward(loss)
        return loss

    smp.init({"partitions": world_size, "microbatches": MICROBATCHES, **entries})
    try:
        model = smp.DistributedModel(build_lm(cfg))  # built on the host: smp places it on this rank's device
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
        losses, steps_ms, bubbles, above_mib = [], [], [], []
        for tokens, targets in data:
            sync()
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            resident = torch.cuda.memory_allocated() if CUDA else 0
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = train_step(model, tokens, targets).reduce_mean().item()
            optimizer.step()
            sync()
            steps_ms.append(1e3 * (time.perf_counter() - start))
            bubbles.append(model.last_step_stats.bubble_fraction)
            above_mib.append((torch.cuda.max_memory_allocated() - resident) / 2**20 if CUDA else 0.0)
            losses.append(float(loss))
        return {
            "losses": losses,
            "median_step_ms": round(statistics.median(steps_ms[1:]), 2),  # the first step partitions the model
            "bubble": round(statistics.median(bubbles[1:]), 4),
            "step_peak_above_resident_mib": round(max(above_mib[1:]), 1),
        }
    finally:
        smp.reset()


def judge_schedule(want: list[float], theory: float, timed: bool, per_rank: list[dict[str, Any]]) -> Outcome:
    """Losses as one process on every rank; with ``timed`` (two GPUs) the measured bubble near the theory."""
    gap = max(loss_gap(r["losses"], want) for r in per_rank)
    bubble = max(r["bubble"] for r in per_rank)
    facts: dict[str, Any] = {f"loss_gap<={LOSS_TOLERANCE}": gap <= LOSS_TOLERANCE}
    if timed:  # two GPUs: the measured bubble means something
        facts[f"bubble<={BUBBLE_SLACK}*theory+{BUBBLE_PLUS}"] = bubble <= BUBBLE_SLACK * theory + BUBBLE_PLUS
    outcome = all_true(facts, "losses as one process; on two GPUs the bubble near the schedule's theory")
    figures = [{k: v for k, v in r.items() if k != "losses"} for r in per_rank]
    value = {**facts, "loss_gap": gap, "bubble_theory": round(theory, 4), "bubble_measured": bubble}
    value.update(bubble_judged=timed, per_rank=figures)
    return Outcome(outcome.ok, value, outcome.threshold, outcome.why)


def pipeline_worker(rank: int, world_size: int, small: bool, record: str, timed: bool) -> None:
    """Every schedule over the ranks against one process on the whole batches; rank 0 records each."""
    from shardkit.bench.gpu_check.parts_ranks import agreed_check
    from shardkit.bench.pipeline_theory import bubble_theory

    res = Results("pipeline", Path(record), resume=True) if rank == 0 else None
    cfg = _config(small)
    ref = build_lm(cfg).to(device())  # drawn on the host as smp's model is (a GPU draws other numbers)
    want = train(ref, torch.optim.SGD(ref.parameters(), lr=0.05), batches(cfg, STEPS + 1, BATCH, seed=300))
    for label, entries in _settings():
        theory = bubble_theory(entries["pipeline"], world_size, MICROBATCHES, entries.get("virtual_stages", 1))
        run = functools.partial(_schedule_run, cfg, entries, world_size)
        agreed_check(res, f"pipeline:{label}", run, functools.partial(judge_schedule, want, theory, timed))


def part_pipeline(res: Results, ctx: PartContext) -> None:
    """Every smp schedule over two ranks (NCCL ``batch_isend_irecv`` on two GPUs), against one process."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.bench.gpu_check.parts_ranks import run_ranks

    form = ctx.form()
    timed = form.multi_gpu and CUDA
    if not timed:
        res.not_run("pipeline:bubble_vs_theory", f"{form.label}: the ranks share one device, their times mean nothing")
    if form.backend != "nccl":
        res.not_run("pipeline:nccl_batch_isend_irecv", f"{form.label}: NCCL between ranks needs two GPUs")
    expected = [f"pipeline:{label}" for label, _ in _settings()]
    run_ranks(res, ctx, pipeline_worker, (ctx.small, str(res.path), timed), expected)
