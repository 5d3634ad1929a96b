"""``shardkit plan --plot``: which settings fit at which world size, at a glance.

One line per setting, peak device memory per rank against world size. No two settings share a colour and line
style (ten colours, then the next line style), each has its own marker; a point is filled where the setting fits
(device memory, and host memory for offloaded state) and hollow where it does not, the device memory is a
labelled horizontal line with the space above it shaded, and the legend sits outside the axes, on the right, so it
never covers a line.

Example::

    fig = draw(results, memory_bytes=80 * 2**30, title="Llama 7B, 2048 tokens per rank")
    fig.savefig("plan.png")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

from shardkit.memory.meter import format_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from shardkit.plan.api import Estimate

GIB = 2**30
_LINE_STYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")


def _palette() -> list[Any]:
    """Twenty colours: tab10's, then the dark shade of each of tab20b's and tab20c's hues."""
    import matplotlib

    tab10 = [matplotlib.colormaps["tab10"](i) for i in range(10)]
    darks = [matplotlib.colormaps[name](i) for name in ("tab20b", "tab20c") for i in range(0, 20, 4)]
    return tab10 + darks


def styles(count: int) -> list[dict[str, Any]]:
    """``count`` distinct (colour, line style, marker) triples: twenty colours; after ten, the line style changes
    too, so no two settings share a colour and line style even past twenty."""
    palette = _palette()
    return [
        {
            "color": palette[i % len(palette)],
            "linestyle": _LINE_STYLES[(i // 10) % len(_LINE_STYLES)],
            "marker": _MARKERS[i % len(_MARKERS)],
        }
        for i in range(count)
    ]


def draw(
    results: Sequence[tuple[Any, Estimate]],
    memory_bytes: int,
    title: str,
    host_memory_bytes: Optional[int] = None,
) -> Figure:
    """The figure for ``results`` (``(setting, estimate)`` pairs; a setting has a ``label``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(setting.label for setting, _ in results))
    largest = max([memory_bytes, *(est.peak_bytes for _, est in results)])
    unit, scale = ("GiB", GIB) if largest >= GIB else ("MiB", 2**20)
    fig, ax = plt.subplots(figsize=(11, 5.5))
    for label, style in zip(labels, styles(len(labels))):
        points = sorted(
            (est.world_size, est.peak_bytes / scale, est.fits(memory_bytes, host_memory_bytes))
            for setting, est in results
            if setting.label == label
        )
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        ax.plot(xs, ys, label=label, markersize=7, **style)
        for x, y, fits in points:
            face = style["color"] if fits else "white"
            ax.plot([x], [y], linestyle="none", marker=style["marker"], markersize=7, color=style["color"],
                    markerfacecolor=face)  # fmt: skip
    limit = memory_bytes / scale
    ax.axhline(limit, color="black", linewidth=1.5, label=f"device memory ({format_bytes(memory_bytes)})")
    top = largest / scale * 1.08
    ax.axhspan(limit, top, color="0.9", zorder=0)
    ax.set_ylim(0, top)
    worlds = sorted({est.world_size for _, est in results})
    if len(worlds) > 1 and worlds[-1] / worlds[0] >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(worlds, [str(w) for w in worlds])
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel(f"peak device memory per rank ({unit})")
    fits_in = f"fits in {format_bytes(memory_bytes)} per device"
    if host_memory_bytes is not None:
        fits_in += f" (offloaded state in {format_bytes(host_memory_bytes)} of host memory)"
    ax.set_title(f"{title}\nfilled marker: {fits_in}; hollow: does not", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)
    fig.tight_layout()
    return fig


def save_plot(
    results: Sequence[tuple[Any, Estimate]],
    path: str,
    memory_bytes: int,
    title: str,
    host_memory_bytes: Optional[int] = None,
) -> None:
    """Draw ``results`` and write the PNG to ``path``."""
    import matplotlib.pyplot as plt

    fig = draw(results, memory_bytes, title, host_memory_bytes)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


__all__ = ["draw", "save_plot", "styles"]
