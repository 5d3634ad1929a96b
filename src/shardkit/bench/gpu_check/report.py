"""The one summary, ``gpu_check.json``: rewritten (atomically) after every part and every check inside one, so
whatever stops the run leaves a readable file; its verdict and the run's exit status come from the checks alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardkit.bench.gpu_check.results import FAIL, NOT_RUN, PASS, write_json_atomic
from shardkit.bench.gpu_check.runner import PartRun
from shardkit.bench.gpu_check.settings import Part


def _part_verdict(run: PartRun, checks: dict[str, Any]) -> tuple[str, str]:
    if run.timed_out:
        running = run.record.get("running")
        during = f" during check {running!r}" if running else ""
        return FAIL, f"killed at its time limit of {run.limit_s:.0f} s{during}"
    if run.rc != 0:
        return FAIL, f"its process exited with status {run.rc}"
    if not checks:
        return FAIL, "it recorded no check"
    failed = [name for name, c in checks.items() if c.get("verdict") not in (PASS, NOT_RUN)]
    return (FAIL, f"failed checks: {', '.join(failed)}") if failed else (PASS, "")


class Summary:
    """The run's document: settings, then per part its verdict and checks, the failures and gaps on top."""

    def __init__(self, path: Path, info: dict[str, Any]) -> None:
        self.path, self.info = path, info
        self.parts: dict[str, dict[str, Any]] = {}
        #: Parts not run for lack of time or because the run was stopped: the run is incomplete.
        self.incomplete: list[str] = []
        self.finished = False

    def progress(self, part: Part, record: dict[str, Any]) -> None:
        """A running part's records so far."""
        checks = record.get("checks", {})
        running = record.get("running")
        why = f"running check {running!r}" if running else "running, between checks"
        self.parts[part.name] = {"verdict": "running", "why": why, "what": part.what, "checks": checks}
        self.write()

    def part_done(self, part: Part, run: PartRun) -> None:
        """A part's process ended (or was killed): its verdict, records and any stack dump."""
        checks = run.record.get("checks", {})
        verdict, why = _part_verdict(run, checks)
        entry: dict[str, Any] = {"verdict": verdict, "why": why, "what": part.what, "limit_s": round(run.limit_s)}
        entry.update(secs=run.secs, rc=run.rc, timed_out=run.timed_out, checks=checks)
        if run.stack_dump:
            entry["stack_dump"] = run.stack_dump[-20000:]
        self.parts[part.name] = entry
        self.write()

    def not_run(self, part: Part, why: str, incomplete: bool) -> None:
        """A part this run does not start; ``incomplete``: for want of time (the run is then incomplete)."""
        self.parts[part.name] = {"verdict": NOT_RUN, "why": why, "what": part.what, "checks": {}}
        if incomplete:
            self.incomplete.append(part.name)
        self.write()

    def stopped(self, why: str) -> None:
        """The runner was stopped: the part running then fails with ``why``; the run stays unfinished."""
        for part in self.parts.values():
            if part.get("verdict") == "running":
                part["verdict"], part["why"] = FAIL, f"{why} ({part['why']})"
        self.write()

    def add_check(self, part: str, name: str, entry: dict[str, Any]) -> None:
        """A check the runner itself makes (``runner:cuda_visible``)."""
        holder = self.parts.setdefault(part, {"verdict": PASS, "why": "", "checks": {}})
        holder["checks"][name] = entry
        if entry["verdict"] == FAIL:
            holder["verdict"], holder["why"] = FAIL, f"failed checks: {name}"
        self.write()

    def lists(self) -> dict[str, list[str]]:
        """Failed checks (and parts that failed as a whole), checks not run (with why), incomplete parts."""
        failed, not_run = [], []
        for name, part in self.parts.items():
            checks = {c if c.startswith(f"{name}:") else f"{name}:{c}": e for c, e in part.get("checks", {}).items()}
            failed += [c for c, e in checks.items() if e.get("verdict") == FAIL]
            not_run += [f"{c}: {e.get('why')}" for c, e in checks.items() if e.get("verdict") == NOT_RUN]
            if part.get("verdict") == FAIL and not any(e.get("verdict") == FAIL for e in checks.values()):
                failed.append(f"{name}: {part.get('why')}")
            if part.get("verdict") == NOT_RUN:
                not_run.append(f"{name}: {part.get('why')}")
        return {"failed": failed, "not_run": not_run, "incomplete": list(self.incomplete)}

    def verdict(self) -> str:
        """``pass``; ``fail`` (a check failed); ``incomplete`` (none failed, but parts went unrun for time)."""
        lists = self.lists()
        if lists["failed"]:
            return FAIL
        return "incomplete" if lists["incomplete"] or not self.finished else PASS

    def exit_code(self) -> int:
        """0 only when the run finished and nothing failed or went unrun for want of time."""
        return 0 if self.verdict() == PASS else 1

    def write(self) -> None:
        """Rewrite the file, atomically."""
        lists = self.lists()
        doc = {"verdict": self.verdict(), "finished": self.finished, **lists, **self.info, "parts": self.parts}
        write_json_atomic(self.path, doc)
