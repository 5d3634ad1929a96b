"""``shardkit checkpoint inspect``: what a checkpoint holds and whether its files are intact, without loading it.

Everything comes from ``meta.json`` and the tensor indexes (DCP ``.metadata`` through the allow-list reader,
``torch.save`` files opened with ``mmap=True``); the verification checks every file's size and SHA-256 against
``meta.json`` (:func:`~shardkit.checkpoint.verify_checkpoint`). No tensor data is read except to hash files.

Example::

    report = inspect_checkpoint("runs/exp1/step_00000100")
    print(format_report(report))
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Optional, Union

from shardkit.checkpoint.api import verify_checkpoint
from shardkit.checkpoint.errors import CheckpointError, CorruptCheckpointError
from shardkit.checkpoint.tools.store import MODEL, CheckpointView
from shardkit.checkpoint.universal.layout import LAYOUT, SIDE_DIR
from shardkit.checkpoint.universal.split import read_tp_layout
from shardkit.memory.meter import format_bytes


def inspect_checkpoint(directory: Union[str, Path], verify: bool = True) -> dict[str, Any]:
    """A JSON-ready description of the checkpoint at ``directory`` (or the latest under it).

    Keys: ``path``, ``step``, ``world_size``, ``strategy``, ``layout``, ``resizable``, ``has_optimizer``,
    ``has_scaler``, ``shardkit_version``, ``torch_version``, ``files`` (count, bytes on disk, and each file with
    its size and SHA-256 as recorded), ``tensors``
    (per tensor: ``key``, ``part``, ``shape``, ``dtype``, ``bytes``, ``chunks``, ``where``), ``totals`` (tensors
    and bytes per part, parameters in the model), ``optimizer_settings`` (universal layout: each distinct param-group
    setting with its number of parameters), ``tensor_parallel`` (universal layout saved with tensor parallelism: the
    ``degree`` and, per split parameter, its full ``shape``, split ``dim``, ``size`` and ``stride``; else None) and
    ``verification`` (``ok`` and, if not, the ``error``).
    """
    view = CheckpointView.open(directory)
    meta = view.meta
    entries = view.entries()
    by_part: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for e in entries:
        by_part[e.part] += e.nbytes
        count[e.part] += 1
    verification: dict[str, Any] = {"ok": None, "error": None}
    if verify:
        try:
            verify_checkpoint(view.directory)
            verification["ok"] = True
        except CheckpointError as err:
            verification = {"ok": False, "error": str(err)}
    return {
        "path": str(view.directory),
        "step": meta.step,
        "world_size": meta.world_size,
        "strategy": meta.strategy,
        "layout": meta.layout,
        "resizable": meta.resizable,
        "has_optimizer": meta.has_optimizer,
        "has_scaler": meta.has_scaler,
        "shardkit_version": meta.shardkit_version,
        "torch_version": meta.torch_version,
        "files": {
            "count": len(meta.files),
            "bytes": sum(r.bytes for r in meta.files.values()),
            "list": [{"name": name, "bytes": r.bytes, "sha256": r.sha256} for name, r in meta.files.items()],
        },
        "tensors": [
            {
                "key": e.key,
                "part": e.part,
                "shape": list(e.shape),
                "dtype": str(e.dtype).removeprefix("torch."),
                "bytes": e.nbytes,
                "chunks": e.chunks,
                "where": e.where,
            }
            for e in entries
        ],
        "totals": {
            "tensors": len(entries),
            "bytes": sum(by_part.values()),
            "parameters": sum(e.nbytes // e.dtype.itemsize for e in entries if e.part == MODEL),
            "by_part": {part: {"tensors": count[part], "bytes": by_part[part]} for part in sorted(count)},
        },
        "optimizer_settings": optimizer_settings(view.directory) if meta.layout == LAYOUT else [],
        "tensor_parallel": read_tp_layout(view.directory) if meta.layout == LAYOUT else None,
        "verification": verification,
    }


def optimizer_settings(directory: Path) -> list[dict[str, Any]]:
    """The distinct param-group settings in a universal checkpoint's JSON side files, each with how many
    parameters use it (empty for other layouts). Tuples and one-element tensors appear as JSON lists/numbers."""
    found: list[dict[str, Any]] = []
    for path in sorted((directory / SIDE_DIR).glob("*.json")):
        try:
            groups = json.loads(path.read_text()).get("groups", {})
        except (OSError, ValueError, AttributeError) as err:
            raise CorruptCheckpointError(f"{path} cannot be read as an optimizer side file ({err})") from None
        for fqn, settings in groups.items():
            plain = _plain(settings)
            entry = next((e for e in found if e["settings"] == plain), None)
            if entry is None:
                entry = {"settings": plain, "parameters": []}
                found.append(entry)
            if fqn not in entry["parameters"]:
                entry["parameters"].append(fqn)
    return [{"settings": e["settings"], "parameters": len(e["parameters"])} for e in found]


def _plain(value: Any) -> Any:
    """Side-file JSON with its tagged tuples and tensors turned into plain lists and numbers."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return [_plain(v) for v in value["__tuple__"]]
        if "__tensor__" in value:
            return value["__tensor__"]
        return {k: _plain(v) for k, v in value.items()}
    return value


def _tp_lines(layout: Optional[dict[str, Any]]) -> list[str]:
    """The tensor-parallel layout the checkpoint was saved with, one line per split parameter."""
    if not layout:
        return []
    params = layout["parameters"]
    lines = [
        f"tensor parallel: saved at degree {layout.get('degree')}, {len(params)} parameters split (stored whole-shaped"
        ", one chunk per rank's slab: loads at any degree that divides them, or without tensor parallelism)"
    ]
    for fqn, p in params.items():
        stride = f", stride {p['stride']}" if p.get("stride", 1) > 1 else ""
        shape = "x".join(map(str, p.get("shape", [])))
        lines.append(f"  {fqn} ({shape}): dimension {p['dim']} across {p['size']} ranks{stride}")
    return lines


def _size(nbytes: int) -> str:
    return format_bytes(nbytes)


def format_report(report: dict[str, Any]) -> str:
    """The report of :func:`inspect_checkpoint` as text: a header, one line per tensor, totals, verification."""
    lines = [
        f"checkpoint  {report['path']}",
        f"step {report['step']}, strategy {report['strategy']}, layout {report['layout']}, "
        f"saved at world size {report['world_size']}"
        + (", loads at any world size" if report["resizable"] else ", loads only at that world size"),
        f"written by shardkit {report['shardkit_version']}, torch {report['torch_version']}; "
        f"{report['files']['count']} files, {_size(report['files']['bytes'])} on disk",
        "",
    ]
    rows = [
        (t["key"], "x".join(map(str, t["shape"])) or "scalar", t["dtype"], _size(t["bytes"]), str(t["chunks"]))
        for t in report["tensors"]
    ]
    headers = ("tensor", "shape", "dtype", "bytes", "chunks")
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    for row in [headers, *rows]:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    totals = report["totals"]
    lines.append("")
    for part, t in totals["by_part"].items():
        lines.append(f"{part}: {t['tensors']} tensors, {_size(t['bytes'])}")
    lines.append(
        f"total: {totals['tensors']} tensors, {_size(totals['bytes'])}; {totals['parameters']:,} model elements"
    )
    lines += _tp_lines(report.get("tensor_parallel"))
    for group in report["optimizer_settings"]:
        settings = ", ".join(f"{k}={v}" for k, v in sorted(group["settings"].items()))
        lines.append(f"optimizer settings of {group['parameters']} parameters: {settings}")
    verification = report["verification"]
    if verification["ok"] is None:
        lines.append("verification: skipped")
    elif verification["ok"]:
        lines.append(f"verification: OK (size and SHA-256 of all {report['files']['count']} files)")
    else:
        lines.append(f"verification: FAILED: {verification['error']}")
    return "\n".join(lines)
