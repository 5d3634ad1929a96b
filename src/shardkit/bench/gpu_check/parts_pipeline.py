"""gpu-check part ``pipeline``: every smp schedule on CUDA tensors, two ranks sharing the one GPU over gloo.

What it shows: the split backward of the zero-bubble schedules (B and W from one saved graph, its node hooks
and saved-tensor slots) runs right where autograd executes nodes on its own CUDA device threads, and every
schedule (1F1B, GPipe, ZB-H1, ZB-H2, ZBV, interleaved over virtual stages, and any other in the config's list)
trains the tied-weight LM exactly as one process does. It also records, per schedule and rank, the median step,
the bubble smp measured (time blocked on receives / step) and the CUDA memory a step allocates above what is
resident before it. The two ranks time-slice one GPU and their sends are staged through host memory by gloo,
so the step times and bubbles are not what two GPUs would show; the memory per rank is (each process has its
own allocator). NCCL refuses two ranks on one GPU, so the NCCL point-to-point path stays untested here.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from shardkit.bench.gpu_check.common import CUDA, DEVICE, Results, batches, build_lm, loss_gap, train
from shardkit.models import LMConfig, TransformerLM

MICROBATCHES = 8
BATCH = 16
STEPS = 3


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


def _pipeline_worker(rank: int, world_size: int, small: bool) -> dict[str, Any]:
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    import shardkit.modelparallel as smp

    if CUDA:
        torch.cuda.set_device(0)  # one GPU for both ranks: only gloo allows that
    cfg = _config(small)
    data = batches(cfg, STEPS + 1, BATCH, seed=300)
    found: dict[str, Any] = {}

    @smp.step
    def train_step(model: Any, tokens: torch.Tensor, targets: torch.Tensor) -> Any:
        loss = TransformerLM.loss_fn(model(tokens), targets)
        model.backward(loss)
        return loss

    for label, entries in _settings():
        smp.init({"partitions": world_size, "microbatches": MICROBATCHES, **entries})
        try:
            model = smp.DistributedModel(build_lm(cfg, DEVICE))
            optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
            losses, steps_ms, bubbles, above_mib = [], [], [], []
            for tokens, targets in data:
                if CUDA:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                resident = torch.cuda.memory_allocated() if CUDA else 0
                start = time.perf_counter()
                optimizer.zero_grad()
                loss = train_step(model, tokens, targets).reduce_mean().item()
                optimizer.step()
                if CUDA:
                    torch.cuda.synchronize()
                steps_ms.append(1e3 * (time.perf_counter() - start))
                bubbles.append(model.last_step_stats.bubble_fraction)
                above_mib.append((torch.cuda.max_memory_allocated() - resident) / 2**20 if CUDA else 0.0)
                losses.append(float(loss))
            found[label] = {
                "losses": losses,
                "median_step_ms": statistics.median(steps_ms[1:]),  # the first step partitions the model
                "bubble": statistics.median(bubbles[1:]),
                "step_peak_above_resident_mib": max(above_mib[1:]),
            }
        except Exception as err:  # a schedule failing on CUDA is the finding; the others still run
            found[label] = f"{type(err).__name__}: {str(err)[:300]}"
        finally:
            smp.reset()
    return found


def part_pipeline(res: Results, small: bool) -> None:
    """Every smp schedule trained over two ranks on the one GPU, against one process on the whole batches."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.testing import run_distributed

    def run() -> dict[str, Any]:
        outs = run_distributed(_pipeline_worker, 2, small, timeout_s=150)
        cfg = _config(small)
        ref = build_lm(cfg, DEVICE)
        want = train(ref, torch.optim.SGD(ref.parameters(), lr=0.05), batches(cfg, STEPS + 1, BATCH, seed=300))
        summary: dict[str, Any] = {}
        ok = True
        for label, _ in _settings():
            per_rank = [out[label] for out in outs]
            failed = [r for r in per_rank if isinstance(r, str)]
            if failed:
                summary[label], ok = failed[0], False
                continue
            gap = max(loss_gap(r["losses"], want) for r in per_rank)
            ok = ok and gap < 1e-4
            summary[label] = {
                "loss_gap_vs_one_process": gap,
                "median_step_ms": [round(r["median_step_ms"], 1) for r in per_rank],
                "bubble": [round(r["bubble"], 3) for r in per_rank],
                "step_peak_above_resident_mib": [round(r["step_peak_above_resident_mib"], 1) for r in per_rank],
            }
        return {"ok": ok, **summary}

    res.check("smp_schedules_two_ranks_one_gpu", run)
