"""gpu-check part ``checkpoint``: an asynchronous checkpoint of FSDP with AdamW state, changed in place the moment
the save returns.

``save_checkpoint(..., async_save=True)`` returns once the rank's share is staged in host memory (pinned,
``non_blocking`` copies from the GPU); the write goes on in a background thread. If staging returned before its
copies landed, or the writer read live tensors, the file would hold the changed values. So: train two AdamW
steps, note every parameter and optimizer tensor, save, at once add 1 to all of them in place (and queue GPU
work), spin the host for seconds while the writer runs, then load into a fresh model and optimizer and compare
with the noted state, bit for bit. The rank's host memory peak during the save is judged too. The same case
runs at two ranks in ``ranks2`` (:func:`async_checkpoint_case`).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.bench.gpu_check.common import CUDA, PartContext, batches, build_lm, device, train, world_of_one
from shardkit.bench.gpu_check.results import Outcome, Results, all_true
from shardkit.models import LMConfig

#: What a save may add to the rank's host memory beyond one copy of what it holds (BENCHMARKS.md's bound).
HOST_SLACK_BYTES = 256 * 2**20


def _config(small: bool) -> LMConfig:
    if small:
        return LMConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, seq_len=16)
    return LMConfig(vocab_size=8192, d_model=1024, n_heads=16, n_layers=8, seq_len=128)  # ~110M parameters


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter and AdamW tensor this rank holds, in a fixed order (live tensors, not copies)."""
    out = [p.data for p in model.parameters()]
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            out += [state[k] for k in sorted(state) if torch.is_tensor(state[k])]
    return out


def _build(cfg: LMConfig) -> tuple[nn.Module, torch.optim.Optimizer]:
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.strategies.registry import OptimizerSpec, get_strategy

    spec = OptimizerSpec(torch.optim.AdamW, {"lr": 1e-3})
    model, optimizer, _ = get_strategy("fsdp").build(build_lm(cfg, device()), spec, dist.group.WORLD)
    return model, optimizer


def _spin_host(seconds: float) -> int:
    """Keep this thread busy (the writer thread runs beside it) for ``seconds``."""
    end, turns = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        turns += 1
    return turns


def async_checkpoint_case(small: bool, root: Path, spin_s: float) -> dict[str, Any]:
    """This rank's facts and figures: the file holds the state at save time, and the host peak it cost."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.bench.rss import PeakRSS
    from shardkit.checkpoint import load_checkpoint, save_checkpoint, wait_for_checkpoint
    from shardkit.utils.torch_compat import cuda_spin

    cfg = _config(small)
    model, optimizer = _build(cfg)
    train(model, optimizer, batches(cfg, 2, 4, seed=21))
    live = _state(model, optimizer)
    noted = [t.detach().cpu().clone() for t in live]
    held = sum(t.numel() * t.element_size() for t in live)
    with PeakRSS() as peak:
        start = time.perf_counter()
        save_checkpoint(root, step=2, model=model, optimizer=optimizer, async_save=True)
        returned_s = time.perf_counter() - start
        with torch.no_grad():
            if CUDA:
                cuda_spin(200_000_000)  # queued ahead of the change: the change lands while the writer reads
            for tensor in live:
                tensor.add_(1)
        _spin_host(spin_s)
        wait_for_checkpoint()
        total_s = time.perf_counter() - start
    fresh, fresh_optimizer = _build(cfg)
    load_checkpoint(root, model=fresh, optimizer=fresh_optimizer)
    loaded = [t.detach().cpu() for t in _state(fresh, fresh_optimizer)]
    same = len(loaded) == len(noted) and all(torch.equal(a, b) for a, b in zip(loaded, noted))
    return {
        "file_holds_state_at_save_time": same,
        f"host_peak<=held+{HOST_SLACK_BYTES >> 20}MiB": peak.rise <= held + HOST_SLACK_BYTES,
        "host_peak_bytes": peak.rise,
        "held_bytes": held,
        "tensors_compared": len(noted),
        "save_returned_s": round(returned_s, 3),
        "save_finished_s": round(total_s, 3),
    }


RULE = "loaded parameters and AdamW state equal the state when save returned (bitwise); host peak <= held + slack"


def judge(per_rank: list[dict[str, Any]]) -> Outcome:
    """Every rank's facts true."""
    facts = {f"rank{r}:{k}": v for r, found in enumerate(per_rank) for k, v in found.items()}
    return all_true(facts, RULE)


def part_checkpoint(res: Results, ctx: PartContext) -> None:
    """The asynchronous sharded checkpoint at world size 1 (NCCL on CUDA)."""
    res.check("backend", world_of_one)
    root = Path(tempfile.mkdtemp(prefix="gpu_check_ckpt_"))
    spin_s = 0.5 if ctx.small else 3.0
    try:
        res.check(
            "checkpoint:async_fsdp_adamw_changed_after_return",
            lambda: judge([async_checkpoint_case(ctx.small, root / "ws1", spin_s)]),
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
