"""The results of ``shardkit bench pipeline``: one :class:`Row` per strategy (:func:`combine`) and the table and
lines printed under it (:func:`print_report`).

Every step time is the slowest rank's; the table gives each strategy's median and minimum (the least disturbed
by other load on a shared machine) against torch's 1F1B and against torch's best schedule of the same run, each
row's measured bubble, peak activation memory and bytes sent per stage (a note under the table says what each
counts), and the line ``our best vs torch's best`` compares smp's fastest schedule with torch's fastest.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass
from typing import Any, Optional

from shardkit.bench.pipeline_settings import PipelineSettings
from shardkit.bench.pipeline_smp import bubble_floor, predicted_bubble
from shardkit.bench.pipeline_theory import bubble_theory, torch_bubble_theory
from shardkit.bench.pipeline_torch import TORCH_SCHEDULES, chunks_per_rank
from shardkit.bench.pipeline_torch_meters import P2P_MISSING
from shardkit.modelparallel.schedules.virtual_schedules import V_PIPELINES
from shardkit.utils.report import format_table, ratio


@dataclass
class Row:
    """One strategy's combined result."""

    name: str
    schedule: str
    median_step_s: float
    min_step_s: float
    final_loss: float
    max_loss_diff_vs_smp: Optional[float]
    bubble_measured: Optional[float]
    bubble_per_stage: Optional[list[float]]
    #: smp: median over steps of the slowest stage's time sharing the step's outputs.
    output_share_s: Optional[float] = None
    #: smp: per stage, the peak bytes of activations saved for backward during one step (MiB).
    peak_activation_mib: Optional[list[float]] = None
    #: smp: per stage, the peak of those and the gradients a split backward keeps for W, together (MiB).
    peak_with_w_grads_mib: Optional[list[float]] = None
    #: smp: per stage, the median milliseconds of one F, B and W (unsplit schedules: B includes W).
    action_ms: Optional[list[dict[str, float]]] = None
    #: smp: the bubble of this schedule's lists simulated with those per-stage times.
    bubble_predicted: Optional[float] = None
    #: smp: the least mean bubble any order of those per-stage times allows (:func:`.pipeline_smp.bubble_floor`).
    bubble_floor: Optional[float] = None
    #: smp: per stage, the last timed step's actions: (action, start s, end s, s blocked on receives).
    trace: Optional[list[list[tuple[str, float, float, float]]]] = None
    #: Model chunks each rank runs (smp's virtual stages or ZBV's two; torch's multi-stage schedules).
    chunks_per_rank: int = 1
    #: The bubble of this schedule with equal F, B and W times; ``None`` where the bench has no model of it.
    bubble_theory: Optional[float] = None
    #: Per stage, the bytes of activations and gradients it sent to other ranks in one step (median over steps;
    #: smp: its stage link's count; torch: its schedules' ``isend`` tensors). ``None``: torch not measurable.
    sent_bytes: Optional[list[int]] = None
    #: Every timed step's time (the slowest rank's), in step order: the strategies ran interleaved, so step ``i``
    #: of two rows saw the same load, and their ratio step by step cancels what drifts between steps.
    step_times_s: Optional[list[float]] = None


def _smp_fields(settings: PipelineSettings, name: str, schedule: str, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """smp's extra measurements of one schedule: bubble (measured and predicted), memory, F/B/W times."""
    costs = [r["smp_costs"][name] for r in per_rank]
    per_stage = [statistics.fmean(r["smp_wait"][name]) for r in per_rank]
    steps = range(settings.steps)
    return {
        "bubble_measured": statistics.fmean(per_stage),
        "bubble_per_stage": per_stage,
        "output_share_s": statistics.median(max(r["smp_share"][name][i] for r in per_rank) for i in steps),
        "peak_activation_mib": [r["smp_peak_activation"][name] / 2**20 for r in per_rank],
        "sent_bytes": [statistics.median_high(r["smp_sent"][name]) for r in per_rank],
        "peak_with_w_grads_mib": [r["smp_peak_with_w_grads"][name] / 2**20 for r in per_rank],
        "action_ms": [{k: v * 1e3 for k, v in c.items()} for c in costs],
        # chunked schedules run on their own tick grid, with no per-action times to replay
        "bubble_predicted": None if settings.smp_chunked else predicted_bubble(schedule, costs, settings.microbatches),
        "bubble_floor": None if settings.smp_chunked else bubble_floor(costs, settings.microbatches),
        "trace": [r["smp_trace"][name] for r in per_rank],
    }


def _torch_fields(name: str, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """torch's measurements of one schedule, as smp's: bubble (receive waits / step), memory, bytes sent; bubble
    and bytes ``None`` where this torch has no helpers to count them at (:mod:`.pipeline_torch_meters`)."""
    fields: dict[str, Any] = {
        "bubble_measured": None,
        "bubble_per_stage": None,
        "peak_activation_mib": [r["torch_peak_activation"][name] / 2**20 for r in per_rank],
    }
    if all(x is not None for r in per_rank for x in r["torch_sent"][name] + r["torch_wait"][name]):
        per_stage = [statistics.fmean(r["torch_wait"][name]) for r in per_rank]
        fields["bubble_measured"], fields["bubble_per_stage"] = statistics.fmean(per_stage), per_stage
        fields["sent_bytes"] = [statistics.median_high(r["torch_sent"][name]) for r in per_rank]
    return fields


def combine(settings: PipelineSettings, per_rank: list[dict[str, Any]]) -> list[Row]:
    """Per strategy: median over steps of the slowest rank's time; the last stage's losses; smp's bubble."""
    rows = []
    last = per_rank[-1]
    smp_schedules = {settings.smp_name(s): s for s in settings.schedules}
    first_smp = settings.smp_name(settings.schedules[0])
    p, m, v = settings.stages, settings.microbatches, settings.virtual_stages
    for name in last["times"]:
        step_times = [max(r["times"][name][i] for r in per_rank) for i in range(settings.steps)]
        # the loss is on the rank of the last chunk: the last rank, or rank 0 under the V placements
        found = (r["losses"][name] for r in reversed(per_rank) if not math.isnan(r["losses"][name][0]))
        losses = next(found, last["losses"][name])
        reference = last["losses"].get(first_smp)
        diff = None
        if reference is not None and name != first_smp:
            diff = max(abs(a - b) for a, b in zip(losses, reference))
        if name in smp_schedules:
            schedule, chunks = smp_schedules[name], 2 if smp_schedules[name] in V_PIPELINES else v
            extra = _smp_fields(settings, name, schedule, per_rank)
            extra["bubble_theory"] = bubble_theory(schedule, p, m, v)
        else:
            torch_schedule = TORCH_SCHEDULES[name]
            schedule, chunks = torch_schedule.short, chunks_per_rank(torch_schedule.layout, v)
            extra = _torch_fields(name, per_rank)
            extra["bubble_theory"] = torch_bubble_theory(schedule, p, m, chunks)
        median, fastest = statistics.median(step_times), min(step_times)
        extra["step_times_s"] = step_times
        rows.append(Row(name, schedule, median, fastest, losses[-1], diff, **extra, chunks_per_rank=chunks))
    return rows


def _percent(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1%}"


def _mib(values: Optional[list[float]]) -> str:
    """``1.25/0.50`` per stage (three significant digits below 1 MiB, so a quick run's KiB still show)."""
    if values is None:
        return "-"
    return "/".join(f"{x:.2f}" if x >= 1 else f"{x:.3g}" for x in values)


def _torch_best(rows: list[Row]) -> tuple[Optional[Row], Optional[Row]]:
    """torch's fastest row of the run by median step, and by minimum step."""
    torch_rows = [r for r in rows if r.name in TORCH_SCHEDULES]
    if not torch_rows:
        return None, None
    return min(torch_rows, key=lambda r: r.median_step_s), min(torch_rows, key=lambda r: r.min_step_s)


def _table(rows: list[Row]) -> str:
    base = next((r for r in rows if r.name == "torch 1F1B"), None)
    best, best_min = _torch_best(rows)
    headers = ["strategy", "schedule", "median ms", "vs torch 1F1B", "vs torch best", "min ms"]
    headers += ["vs torch 1F1B (min)", "vs torch best (min)", "bubble measured", "bubble theory"]
    headers += ["peak act. MiB/stage", "sent MiB/stage", "loss", "loss diff"]
    table = []
    for r in rows:
        sent = None if r.sent_bytes is None else [b / 2**20 for b in r.sent_bytes]
        table.append(
            [
                r.name,
                r.schedule + (f" x{r.chunks_per_rank} chunks" if r.chunks_per_rank > 1 else ""),
                f"{r.median_step_s * 1e3:.0f}",
                ratio(r.median_step_s, base.median_step_s if base else None),
                ratio(r.median_step_s, best.median_step_s if best else None),
                f"{r.min_step_s * 1e3:.0f}",
                ratio(r.min_step_s, base.min_step_s if base else None),
                ratio(r.min_step_s, best_min.min_step_s if best_min else None),
                _percent(r.bubble_measured),
                _percent(r.bubble_theory),
                _mib(r.peak_activation_mib),
                _mib(sent),
                f"{r.final_loss:.4f}",
                "-" if r.max_loss_diff_vs_smp is None else f"{r.max_loss_diff_vs_smp:.1e}",
            ]
        )
    return format_table(headers, table)


def best_line(rows: list[Row]) -> Optional[str]:
    """``our best vs torch's best: 0.93x ...``: smp's fastest schedule against torch's fastest, by median step
    (and by minimum step), or ``None`` when either side did not run."""
    ours = [r for r in rows if r.name not in TORCH_SCHEDULES]
    best, best_min = _torch_best(rows)
    if not ours or best is None or best_min is None:
        return None
    mine, mine_min = min(ours, key=lambda r: r.median_step_s), min(ours, key=lambda r: r.min_step_s)
    paired = paired_ratio(mine, best)
    return (
        f"our best vs torch's best: {ratio(mine.median_step_s, best.median_step_s)} (median step: {mine.name} "
        f"{mine.median_step_s * 1e3:.0f} ms vs {best.name} {best.median_step_s * 1e3:.0f} ms; min step: "
        f"{ratio(mine_min.min_step_s, best_min.min_step_s)}, {mine_min.name} vs {best_min.name}"
        + ("" if paired is None else f"; step by step, median of the same steps' ratios: {paired:.2f}x")
        + ")"
    )


def paired_ratio(row: Row, baseline: Row) -> Optional[float]:
    """Median over steps of ``row``'s step over ``baseline``'s same step (None without per-step times)."""
    if not row.step_times_s or not baseline.step_times_s:
        return None
    return statistics.median(a / b for a, b in zip(row.step_times_s, baseline.step_times_s))


def _print_smp_bubbles(smp_rows: list[Row]) -> None:
    for smp_row in smp_rows:
        assert smp_row.bubble_per_stage is not None and smp_row.action_ms is not None
        print(
            f"{smp_row.name} bubble per stage (time blocked on receives / step time): "
            + ", ".join(f"stage {i}: {b:.1%}" for i, b in enumerate(smp_row.bubble_per_stage))
            + (
                ""  # chunked schedules time no single actions
                if smp_row.bubble_predicted is None
                else "; F/B/W ms per micro-batch: "
                + ", ".join("/".join(f"{ms[k]:.0f}" for k in "FBW") for ms in smp_row.action_ms)
                + f"; bubble of its lists with these times: {smp_row.bubble_predicted:.1%}"
                + f" (no order of these times idles less than {smp_row.bubble_floor or 0.0:.1%})"
            )
        )


def _print_smp_ratios(smp_rows: list[Row]) -> None:
    """Each smp schedule against the first: bubble, peak activation memory (largest stage), median step."""
    if len(smp_rows) < 2:
        return
    first = smp_rows[0]
    for r in smp_rows[1:]:
        assert r.bubble_measured is not None and first.bubble_measured is not None
        assert r.peak_activation_mib is not None and first.peak_activation_mib is not None
        assert r.peak_with_w_grads_mib is not None
        worst = max(a / b for a, b in zip(r.peak_activation_mib, first.peak_activation_mib) if b > 0)
        print(
            f"{r.name} vs {first.name}: bubble {ratio(r.bubble_measured, first.bubble_measured)}, peak activation "
            f"memory (largest stage) {ratio(max(r.peak_activation_mib), max(first.peak_activation_mib))}, on the "
            f"stage it grows most {worst:.2f}x, median step {ratio(r.median_step_s, first.median_step_s)}"
        )
        if r.peak_with_w_grads_mib != r.peak_activation_mib:
            print(
                f"  {r.name} with the gradients kept for W (which the unsplit backward makes too, but only while it "
                "runs, uncounted): " + "/".join(f"{x:.1f}" for x in r.peak_with_w_grads_mib) + " MiB per stage, "
                f"largest {ratio(max(r.peak_with_w_grads_mib), max(first.peak_activation_mib))}"
            )


def _print_column_notes(rows: list[Row]) -> None:
    """What the measured columns count, once under the table (and why a torch row has "-")."""
    print(
        "bubble measured: each stage's time blocked on receives / its step time, averaged over stages (smp: its "
        "stage link's receive waits; torch: its waits on P2P batches holding a receive). peak act.: bytes saved "
        "for backward at their peak over one extra step (one saved-tensor meter for both). sent: bytes of "
        "activations and gradients each stage sent to other ranks per step (smp: its stage link; torch: the "
        "isend tensors its schedule posts); not counted: smp's sharing of the step's outputs (a broadcast of the "
        "per-micro-batch losses from the output stage, its cost printed below), either side's first-step shape "
        "exchange, nor the tied weight's gradient sum"
    )
    if any(r.name in TORCH_SCHEDULES and r.sent_bytes is None for r in rows):
        print(f"torch rows' bubble measured and sent: - ({P2P_MISSING})")


def print_report(
    settings: PipelineSettings,
    rows: list[Row],
    placement: Optional[str],
    cuts: dict[str, str],
    skipped: dict[str, str],
) -> None:
    """The table, then smp's per-stage bubbles and schedule ratios, ``our best vs torch's best``, smp's
    placement, torch's cuts (``cuts``: layout -> description) and the torch schedules that did not run."""
    p, m = settings.stages, settings.microbatches
    print(
        f"pipeline: LM {settings.lm.n_layers} blocks x d{settings.lm.d_model}, vocab {settings.lm.vocab_size}, "
        f"seq {settings.lm.seq_len}; {p} stages x {m} micro-batches, global batch {settings.global_batch}; gloo/CPU; "
        f"median of {settings.steps} steps after {settings.warmup} warm-up; load average {os.getloadavg()[0]:.1f}"
    )
    print(_table(rows))
    _print_column_notes(rows)
    smp_rows = [r for r in rows if r.name not in TORCH_SCHEDULES and r.bubble_per_stage is not None]
    _print_smp_bubbles(smp_rows)
    _print_smp_ratios(smp_rows)
    if smp_rows:
        returns = "(loss, loss.item())" if settings.smp_item_outputs else "(loss,)"
        share = smp_rows[0].output_share_s or 0.0
        print(
            f"smp step returns {returns}: sharing the outputs from the output stage took {share * 1e3:.2f} ms "
            f"per step (median of the slowest stage), {share / smp_rows[0].median_step_s:.2%} of the step"
        )
    line = best_line(rows)
    if line:
        print(line)
    if placement:
        print(placement)
    for layout, description in cuts.items():
        print(f"torch.pipelining {layout}: {description}")
    for name, reason in skipped.items():
        print(f"{name}: skipped ({reason})")
