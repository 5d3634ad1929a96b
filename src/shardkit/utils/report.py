"""Plain-text tables for the benchmark and demo output (also valid GitHub Markdown)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, is_dataclass
from typing import Any, Optional


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table with padded columns; the first column is left-aligned, the others right-aligned.

    Example::

        print(format_table(["strategy", "ms"], [["ddp", "12.0"]]))
    """
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]

    def line(cells: Sequence[str]) -> str:
        padded = [str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if i else ("-" * (w + 2)) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def ratio(value: Optional[float], baseline: Optional[float]) -> str:
    """``value / baseline`` as ``'0.62x'``, or ``'-'`` when either is missing."""
    if value is None or baseline is None or baseline == 0 or math.isnan(value) or math.isnan(baseline):
        return "-"
    return f"{value / baseline:.2f}x"


def unavailable_lines(missing: Mapping[str, str], failed: Mapping[str, str]) -> list[str]:
    """Lines naming strategies that were not available here, or failed while running."""
    lines = [f"  {name}: not available ({reason})" for name, reason in missing.items()]
    lines += [f"  {name}: FAILED ({error})" for name, error in failed.items()]
    return lines


def write_json(path: str, payload: Any) -> None:
    """Write ``payload`` (dataclasses allowed) as indented JSON, for scripts and tests that read results."""

    def default(obj: Any) -> Any:
        if is_dataclass(obj) and not isinstance(obj, type):
            return asdict(obj)
        raise TypeError(f"cannot write {type(obj).__name__} as JSON")

    with open(path, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2, default=default)
