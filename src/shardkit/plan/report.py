"""What ``shardkit plan`` prints and writes: the table, the recommendation per world size, and the JSON document.

The JSON document (``--json``) holds everything a script needs to act on a plan without re-deriving it::

    {"device_memory_bytes": ..., "host_memory_bytes": ..., "backend": "nccl", "world_sizes": [8, 64],
     "estimates": [{"setting": "zero3 (fsdp, reshard)", "fits": true, "strategy": "fsdp", "world_size": 8,
                    "peak_bytes": ..., ...every Estimate field...}, ...],
     "recommendations": [{"world_size": 8, "setting": "...", "strategy": "fsdp", "peak_bytes": ...,
                          "step_seconds": ..., "text": "world size 8: recommended ..."}, ...],
     "not_planned": ["setting xN: why", ...]}

A world size where nothing fits has ``"setting": null`` in its recommendation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

from shardkit.memory.meter import format_bytes

if TYPE_CHECKING:
    from shardkit.plan.api import Estimate
    from shardkit.plan.settings import Setting
    from shardkit.plan.workloads import Workload

Result = tuple["Setting", "Estimate"]


def table(results: Sequence[Result], memory: int, host_memory: Optional[int] = None) -> str:
    """One line per estimate, by world size, those that fit first, fastest first."""
    gib = 2**30
    width = max([36, *(len(setting.label) for setting, _ in results)])
    lines = [
        f"{'world':>5}  {'setting':<{width}} {'peak GiB':>9} {'state GiB':>9} {'host GiB':>9} {'sends GiB':>9} "
        f"{'inter GiB':>9} {'step ms':>9}  fits"
    ]

    def order(result: Result) -> tuple[int, bool, float]:
        est = result[1]
        return est.world_size, not est.fits(memory, host_memory), est.step_seconds

    for setting, est in sorted(results, key=order):
        sends = sum(est.comm_bytes.values()) / gib
        inter = f"{sum(est.inter_node_bytes.values()) / gib:>9.3f}" if est.nprocs_per_node else f"{'-':>9}"
        host = f"{est.host.peak_bytes / gib:>9.2f}" if est.host.peak_bytes else f"{'-':>9}"
        lines.append(
            f"{est.world_size:>5}  {setting.label:<{width}} {est.peak_bytes / gib:>9.2f} {est.state_bytes / gib:>9.2f} "
            f"{host} {sends:>9.3f} {inter} {est.step_seconds * 1e3:>9.1f}  "
            f"{'yes' if est.fits(memory, host_memory) else 'no'}"
        )
    return "\n".join(lines)


def fitting(results: Sequence[Result], memory: int, world_size: int, host_memory: Optional[int] = None) -> list[Result]:
    """The settings that fit at ``world_size``, fastest first. SlowMo trains a different algorithm (local SGD
    between nodes), so it is listed in the table but never recommended."""
    found = [
        r
        for r in results
        if r[1].world_size == world_size and r[1].fits(memory, host_memory) and r[0].strategy != "slowmo"
    ]
    return sorted(found, key=lambda r: r[1].step_seconds)


def recommend(results: Sequence[Result], memory: int, world_size: int, host_memory: Optional[int] = None) -> str:
    """The fastest setting that fits at ``world_size`` (device memory ``memory``; offloaded state within
    ``host_memory`` per rank when given), and why."""
    fits = fitting(results, memory, world_size, host_memory)
    if not fits:
        host = f" and {format_bytes(host_memory)} of host memory per rank" if host_memory is not None else ""
        return f"world size {world_size}: nothing fits in {format_bytes(memory)} per device{host}"
    best, est = fits[0]
    why = f"the fastest predicted step ({est.step_seconds * 1e3:.1f} ms) among the {len(fits)} settings that fit"
    if len(fits) > 1:
        runner_up = fits[1][1]
        why += f"; next {fits[1][0].label} at {runner_up.step_seconds * 1e3:.1f} ms"
    too_big = [r for r in results if r[1].world_size == world_size and not r[1].fits(memory, host_memory)]
    if too_big:
        listed = ", ".join(f"{s.label} {format_bytes(e.peak_bytes)}" for s, e in too_big[:3])
        why += f"; {len(too_big)} do not fit ({listed}{', ...' if len(too_big) > 3 else ''})"
    host = f" and {format_bytes(est.host.peak_bytes)} of host memory" if est.host.peak_bytes else ""
    return (
        f"world size {world_size}: recommended {best.label}: peak {format_bytes(est.peak_bytes)} of "
        f"{format_bytes(memory)}{host}, {why}"
    )


def plan_document(
    results: Sequence[Result],
    world_sizes: Sequence[int],
    memory: int,
    host_memory: Optional[int],
    backend: str,
    not_planned: Sequence[str],
) -> dict[str, Any]:
    """The ``--json`` document (see the module docstring)."""
    recommendations = []
    for world_size in world_sizes:
        fits = fitting(results, memory, world_size, host_memory)
        best = fits[0] if fits else None
        recommendations.append(
            {
                "world_size": world_size,
                "setting": best[0].label if best else None,
                "strategy": best[0].strategy if best else None,
                "peak_bytes": best[1].peak_bytes if best else None,
                "step_seconds": best[1].step_seconds if best else None,
                "text": recommend(results, memory, world_size, host_memory),
            }
        )
    return {
        "device_memory_bytes": memory,
        "host_memory_bytes": host_memory,
        "backend": backend,
        "world_sizes": list(world_sizes),
        "estimates": [{"setting": s.label, "fits": e.fits(memory, host_memory), **e.to_dict()} for s, e in results],
        "recommendations": recommendations,
        "not_planned": list(not_planned),
    }


def position_hint(work: Workload) -> str:
    """Why a transformers model may not run at the planned sequence length, when that is the likely reason."""
    if work.kind != "hf" or work.task == "image_classification":
        return ""
    config = work.hf_config()
    for field in ("n_positions", "max_position_embeddings"):
        limit = getattr(config, field, None)
        if isinstance(limit, int) and work.seq_len > limit:
            return (
                f" (--seq-len {work.seq_len} is longer than the config's {field}={limit}: if the model has learned "
                f"positions, plan it with the override {field}={work.seq_len})"
            )
    return ""


def print_failures(failed: Sequence[str]) -> None:
    """The settings that could not be planned, one line per distinct reason (a broken model fails them all)."""
    by_reason: dict[str, list[str]] = {}
    for line in failed:
        setting, _, reason = line.partition(": ")
        by_reason.setdefault(reason, []).append(setting)
    for reason, settings in by_reason.items():
        print(f"not planned: {', '.join(settings)}: {reason}")


def plot_title(work: Workload) -> str:
    """What was planned, for the plot's title."""
    if work.kind == "hf":
        what = f"transformers {os.path.basename(work.name) or work.name} ({work.task.replace('_', ' ')})"
        size = f"{work.batch_size} x {work.seq_len} tokens per rank" if work.task != "image_classification" else ""
    else:
        what = {"bench_lm": "shardkit bench LM", "demo_lm": "shardkit demo LM"}.get(work.kind, work.name)
        size = f"{work.batch_size} x {work.seq_len} tokens per rank"
    return f"Peak memory per rank: {what}" + (f", {size}" if size else "")


__all__ = ["fitting", "plan_document", "plot_title", "position_hint", "print_failures", "recommend", "table"]
