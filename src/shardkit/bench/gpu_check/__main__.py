"""Run the gpu-check parts, each in its own process group under its own time limit; write one JSON and one log.

    python3 -m shardkit.bench.gpu_check [--out DIR] [--small | --dry-run] [--parts env,fsdp] [--expect-gpu]

``DIR`` (default ``$OUT``, else ``./gpu_check_out``) receives exactly two files, whatever happens:
``gpu_check.json`` (rewritten after every part and every check: each check's verdict, why, value and threshold)
and ``gpu_check.log`` (every part's output). Exit status 0 when every check passed or does not apply to this
machine; 1 when one failed, when parts went unrun for want of time, or when a machine expected to have a GPU
shows no CUDA (``--expect-gpu`` is on unless ``--small`` or ``--dry-run``, and whenever ``/dev/nvidia*`` or
``nvidia-smi`` is there).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, NoReturn, Optional

from shardkit.bench.gpu_check.report import Summary
from shardkit.bench.gpu_check.results import FAIL, PASS
from shardkit.bench.gpu_check.runner import PartProcess, part_command, run_part
from shardkit.bench.gpu_check.settings import (
    BUDGET_S,
    MIN_PART_S,
    PARTS,
    Part,
    expect_gpu,
    gpu_evidence,
    part_named,
    rank_form,
)


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 -m shardkit.bench.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true", help="every part at toy sizes on any device")
    size.add_argument("--dry-run", action="store_true", help="the plumbing only: the env part at toy size")
    parser.add_argument("--parts", default="", help="comma-separated: " + ", ".join(p.name for p in PARTS))
    expect_help = "fail without CUDA (default: on unless --small/--dry-run, or when a GPU is visible)"
    parser.add_argument("--expect-gpu", action=argparse.BooleanOptionalAction, default=None, help=expect_help)
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="wall seconds for all parts together")
    parser.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="PART=SECONDS",
        help="override one part's time limit (repeatable)",
    )
    args = parser.parse_args(argv)
    try:  # a wrong name or limit is refused before anything is written
        for name in [n.strip() for n in args.parts.split(",") if n.strip()]:
            part_named(name)
        for item in args.limit:
            part_named(item.split("=", 1)[0])
            float(item.split("=", 1)[1])
    except (ValueError, IndexError) as err:
        parser.error(f"{err} (--parts takes names, --limit PART=SECONDS)")
    return args


#: ``--small`` without CUDA gets this many times each part's limit and the budget: the limits are the H200's, and
#: the CPU run (toy sizes, a busy shared machine) checks the script, not the budget.
CPU_SMALL_SCALE = 2.0


def _chosen(args: argparse.Namespace, scale: float) -> list[Part]:
    """The parts asked for, in the run's order, with their limits (``--limit`` overrides are taken as given)."""
    names = [n.strip() for n in args.parts.split(",") if n.strip()] or [p.name for p in PARTS]
    limits = dict(item.split("=", 1) for item in args.limit)
    chosen = [part_named(name) for name in names]
    return [Part(p.name, int(float(limits[p.name]) if p.name in limits else p.limit_s * scale), p.what) for p in chosen]


def _on_signal(summary: Summary) -> Any:
    def handler(signum: int, frame: Any) -> NoReturn:
        PartProcess.kill()
        summary.stopped(f"the run was stopped by signal {signum}")
        sys.exit(128 + signum)

    return handler


def _run_parts(parts: list[Part], args: argparse.Namespace, summary: Summary, log: IO[str], gate: str) -> None:
    """Run the chosen parts in order under the budget; ``gate`` (non-empty, the reason) keeps every part but
    ``env`` and the plumbing's self-tests from running."""
    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="gpu_check_parts_"))
    try:
        for part in parts:
            if gate and part.name != "env" and not part.name.startswith("selftest"):
                summary.not_run(part, gate, incomplete=False)
                continue
            left = args.budget - (time.perf_counter() - start)
            if left < MIN_PART_S:
                summary.not_run(part, f"not run: {left:.0f} s left of the {args.budget:.0f} s budget", incomplete=True)
                continue
            limit = min(part.limit_s, left)
            record, stack = work / f"{part.name}.json", work / f"{part.name}.stack"
            small = args.small or bool(gate)
            command = part_command(part.name, record, stack, limit, small)
            progress = functools.partial(summary.progress, part)
            run = run_part(part.name, limit, command, record, stack, log, progress)
            summary.part_done(part, run)
            print(f"gpu-check: {part.name}: {summary.parts[part.name]['verdict']} in {run.secs}s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _machine(args: argparse.Namespace, log: IO[str]) -> dict[str, Any]:
    """What this machine is, said in the log's first lines (before anything can fail) and kept for the JSON."""
    expected, because = expect_gpu(args.expect_gpu, args.small, args.dry_run)
    head = f"gpu-check: expecting a GPU: {'yes' if expected else 'no'} ({because}); evidence: {gpu_evidence()}"
    print(head, file=log, flush=True)
    import torch  # after the first log line: a torch that fails to import still leaves the reason above

    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    form = rank_form(cuda, count)
    line = f"gpu-check: torch {torch.__version__}, CUDA: {cuda}, GPUs: {count}; two-rank form: {form.label}"
    print(line, file=log, flush=True)
    print(head + "\n" + line, flush=True)
    return {"expect_gpu": expected, "expect_gpu_why": because, "cuda": cuda, "gpus": count, "rank_form": form.label,
            "small": args.small, "dry_run": args.dry_run, "torch": torch.__version__,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}  # fmt: skip


def _gate(args: argparse.Namespace, info: dict[str, Any], summary: Summary) -> str:
    """The runner's own check (CUDA where a GPU is expected); why the GPU parts do not run, or '' when they do."""
    if info["expect_gpu"]:
        ok = info["cuda"]
        why = "" if ok else f"no CUDA, but this run expects a GPU ({info['expect_gpu_why']})"
        entry = {"verdict": PASS if ok else FAIL, "why": why, "value": {"gpus": info["gpus"]}, "threshold": "CUDA"}
        summary.add_check("runner", "cuda_visible", entry)
        if not ok:
            return "not run: no CUDA on a machine expected to have a GPU (only env ran, at toy size)"
    return "not run: --dry-run (the plumbing only)" if args.dry_run else ""


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; returns the exit status."""
    args = _parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "gpu_check.log").open("w") as log:
        info = _machine(args, log)
        scale = CPU_SMALL_SCALE if args.small and not info["cuda"] else 1.0
        args.budget *= scale
        parts = _chosen(args, scale)
        summary = Summary(out / "gpu_check.json", {**info, "budget_s": args.budget, "limit_scale": scale})
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, _on_signal(summary))
        _run_parts(parts, args, summary, log, _gate(args, info, summary))
        summary.finished = True
        summary.write()
    lists = summary.lists()
    print(f"gpu-check: {summary.verdict()}; failed: {lists['failed']}; json: {summary.path}", flush=True)
    return summary.exit_code()


if __name__ == "__main__":
    sys.exit(main())
