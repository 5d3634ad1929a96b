"""One part's check records: every check ends with a verdict (pass, fail or not run, with why), its value and the
threshold it was judged against, and the part's record file is rewritten atomically after every check.

This module imports no torch: the runner and the plumbing self-test read and write records without it.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

PASS, FAIL, NOT_RUN = "pass", "fail", "not run"
VERDICTS = (PASS, FAIL, NOT_RUN)


@dataclass(frozen=True)
class Outcome:
    """What a check found: ``ok`` judged ``value`` against ``threshold`` (a number, or words saying the rule)."""

    ok: bool
    value: Any
    threshold: Any
    why: str = ""


class NotRun(Exception):
    """Raised by a check that does not apply here (one GPU for a two-GPU check); the message says why."""


def at_most(value: float, limit: float, what: str) -> Outcome:
    """Pass when ``value <= limit``."""
    ok = value <= limit
    return Outcome(ok, value, f"<= {limit}", "" if ok else f"{what} {value:.4g} is above {limit}")


def at_least(value: float, limit: float, what: str) -> Outcome:
    """Pass when ``value >= limit``."""
    ok = value >= limit
    return Outcome(ok, value, f">= {limit}", "" if ok else f"{what} {value:.4g} is below {limit}")


def all_true(facts: dict[str, Any], rule: str) -> Outcome:
    """Pass when every entry of ``facts`` whose value is a bool is True; the false ones are named."""
    false = [k for k, v in facts.items() if v is False]
    return Outcome(not false, facts, rule, f"false: {', '.join(false)}" if false else "")


def write_json_atomic(path: Path, doc: Any) -> None:
    """Write ``doc`` to ``path`` through a temporary sibling and a rename: a reader (or a kill) never sees half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)


def read_json(path: Path) -> Optional[dict[str, Any]]:
    """The document at ``path``, or None when it is missing or unreadable."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


class Results:
    """The checks of one part, written to ``path`` after every check (the runner copies them into the summary
    while the part runs, so a part killed at its limit keeps what it finished).

    ``resume=True`` continues a file another process wrote (rank 0 of a part's ranks adds its checks)."""

    def __init__(self, part: str, path: Path, resume: bool = False) -> None:
        self.part, self.path = part, path
        old = read_json(path) if resume else None
        self.checks: dict[str, dict[str, Any]] = dict(old["checks"]) if old else {}
        self.flush()

    def check(self, name: str, fn: Callable[[], Outcome]) -> Optional[Outcome]:
        """Run ``fn`` and record its verdict; an exception is a failure with its message (the part goes on)."""
        print(f"[{self.part}:{name}] start {time.strftime('%H:%M:%S')}", flush=True)
        self.flush(running=name)
        start = time.perf_counter()
        outcome: Optional[Outcome] = None
        try:
            outcome = fn()
            entry: dict[str, Any] = {
                "verdict": PASS if outcome.ok else FAIL,
                "why": outcome.why,
                "value": outcome.value,
                "threshold": outcome.threshold,
            }
        except NotRun as reason:
            entry = {"verdict": NOT_RUN, "why": str(reason), "value": None, "threshold": None}
        except Exception as err:  # the check reports every failure; the part goes on
            entry = {
                "verdict": FAIL,
                "why": f"{type(err).__name__}: {err}"[:4000],
                "value": None,
                "threshold": None,
                "trace": traceback.format_exc()[-4000:],
            }
        entry["secs"] = round(time.perf_counter() - start, 2)
        self.record(name, entry)
        return outcome

    def reload(self) -> None:
        """Take in the checks another process (rank 0 of this part's ranks) added to the file."""
        doc = read_json(self.path)
        if doc is not None:
            self.checks = dict(doc.get("checks", {}))
        self.flush()

    def not_run(self, name: str, why: str) -> None:
        """Record a check that this machine does not run, and why."""
        self.record(name, {"verdict": NOT_RUN, "why": why, "value": None, "threshold": None, "secs": 0.0})

    def record(self, name: str, entry: dict[str, Any]) -> None:
        """Store one finished check and rewrite the file."""
        self.checks[name] = entry
        print(f"[{self.part}:{name}] {json.dumps(entry, default=str)}", flush=True)
        self.flush()

    def flush(self, running: Optional[str] = None) -> None:
        """Write what is known so far (atomically), and which check is running now."""
        doc = {"part": self.part, "pid": os.getpid(), "running": running, "checks": self.checks}
        write_json_atomic(self.path, doc)
