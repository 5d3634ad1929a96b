"""Sphinx extension: the Benchmarks page's tables and plot, made at build time from docs/benchmarks/current.json.

One data file holds the current figure of each comparison; this writes ``docs/benchmarks/generated/<name>.md``
(the table, its setting and the command that reproduces it) and ``generated/current.png`` (one bar chart per
comparison, matplotlib). Neither is committed; ``docs/benchmarks/index.md`` includes them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

from sphinx.application import Sphinx

HERE = Path(__file__).resolve().parents[1] / "benchmarks"
DATA = HERE / "current.json"
OUT = HERE / "generated"


def _cell(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def table(entry: Dict[str, Any]) -> str:
    """The comparison as a Markdown table, with its setting and the command that reproduces it."""
    lines = [f"Setting: {entry['setting']}.", "", "| " + " | ".join(entry["columns"]) + " |"]
    lines.append("|" + "|".join("---" if i == 0 else "--:" for i in range(len(entry["columns"]))) + "|")
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in entry["rows"]]
    lines += ["", "Reproduce with:", "", "```bash", entry["command"], "```", ""]
    lines.append(f"The run and its notes: [history](history.md), section \u201c{entry['source']}\u201d.")
    return "\n".join(lines) + "\n"


def _number(value: Any) -> float:
    return float(str(value).rstrip("%x"))


def plot(entries: Dict[str, Dict[str, Any]], path: Path) -> None:
    """One horizontal bar chart per comparison, one under the other (magnitudes: an error of -3% draws as 3)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(entries)
    heights = [0.9 + 0.32 * len(entries[name]["rows"]) for name in names]
    figure, axes = plt.subplots(
        len(names),
        1,
        figsize=(8, sum(heights) + 0.6 * len(names)),
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    for ax, name in zip(axes.flat, names):
        entry = entries[name]
        labels: List[str] = [str(row[0]) for row in entry["rows"]]
        values = [abs(_number(row[entry["plot"]["value"]])) for row in entry["rows"]]
        ax.barh(range(len(values)), values, color="#4c72b0")
        ax.set_yticks(range(len(values)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(entry["plot"]["xlabel"], fontsize=8)
        ax.set_title(entry["title"], fontsize=10)
        for y, value in enumerate(values):
            ax.annotate(f"{value:g}", (value, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
        ax.margins(x=0.15)
    figure.tight_layout()
    figure.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(figure)


def _write(app: Sphinx) -> None:
    entries = {k: v for k, v in json.loads(DATA.read_text()).items() if not k.startswith("_")}
    OUT.mkdir(exist_ok=True)
    for name, entry in entries.items():
        target = OUT / f"{name}.md"
        text = table(entry)
        if not target.exists() or target.read_text() != text:
            target.write_text(text)
    image = OUT / "current.png"
    newest_input = max(DATA.stat().st_mtime, Path(__file__).stat().st_mtime)
    if not image.exists() or image.stat().st_mtime < newest_input:
        plot(entries, image)


def setup(app: Sphinx) -> Dict[str, Any]:
    app.connect("builder-inited", _write)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
