#!/usr/bin/env python3
"""Run one ``shardkit bench`` suite on two git revisions, alternating, and print after/before ratios.

A refactor that should not change speed is checked by running the same benchmark on the revision before it and
the revision after it, in turns (before, after, before, after, ...) so that whatever else loads the machine
lands on both about equally. Each revision is checked out once into a temporary worktree and imported from its
``src`` with this interpreter (so both run on the same torch).

Per strategy it prints the median step of each revision (the median over rounds of each round's median step),
after/before, and the ratio that load drift cancels from: within each run, the strategy's step over the first
strategy's step of the same step (the suites interleave strategies step by step), median over steps and rounds,
after's over before's. The losses must be equal: a refactor that changes them changed training.

    python tools/paired_revisions.py --before 6d85ea3 --after HEAD --suite zero --rounds 3 -- --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _checkout(rev: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(into), rev], check=True)
    return into


def _bench(tree: Path, suite: str, extra: list[str], out: Path) -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    cmd = [sys.executable, "-m", "shardkit.cli", "bench", suite, "--json", str(out), *extra]
    subprocess.run(cmd, check=True, env=env, cwd=tree, stdout=subprocess.DEVNULL)
    results = json.loads(out.read_text())["results"]
    return {r["name"]: r for r in results if not r.get("error")}


def _vs_first(runs: list[dict[str, dict]], name: str) -> float:
    """Median over every step of every run of ``name``'s step time over the first strategy's in that step."""
    ratios = []
    for run in runs:
        first = next(iter(run.values()))["step_times"]
        ratios += [t / f for t, f in zip(run[name]["step_times"], first)]
    return statistics.median(ratios)


def _report(args: argparse.Namespace, runs: dict[str, list[dict[str, dict]]]) -> None:
    rounds = len(runs["after"])
    print(f"suite {args.suite}, {rounds} rounds, before {args.before}, after {args.after}, extra {args.extra}")
    print("| strategy | before ms | after ms | after/before | per step vs first, after/before | same loss |")
    print("|---|--:|--:|--:|--:|---|")
    for name in runs["before"][0]:
        if not all(name in r for side in runs.values() for r in side):
            continue
        before = [r[name]["median_step_s"] for r in runs["before"]]
        after = [r[name]["median_step_s"] for r in runs["after"]]
        paired = _vs_first(runs["after"], name) / _vs_first(runs["before"], name)
        same = all(rb[name]["losses"] == ra[name]["losses"] for rb, ra in zip(runs["before"], runs["after"]))
        b, a = statistics.median(before), statistics.median(after)
        print(f"| {name} | {b * 1e3:.0f} | {a * 1e3:.0f} | {a / b:.2f}x | {paired:.2f}x | {'yes' if same else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--suite", default="zero")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("extra", nargs="*", help="passed to the suite (after --)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="paired-") as tmp:
        trees = {side: _checkout(getattr(args, side), Path(tmp) / side) for side in ("before", "after")}
        runs: dict[str, list[dict[str, dict]]] = {"before": [], "after": []}
        try:
            for i in range(args.rounds):
                for side in ("before", "after"):
                    runs[side].append(_bench(trees[side], args.suite, args.extra, Path(tmp) / f"{side}{i}.json"))
                print(f"after round {i + 1} of {args.rounds}:", flush=True)
                _report(args, runs)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


if __name__ == "__main__":
    main()
