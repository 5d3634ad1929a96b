"""Automatic partitioning: pick the modules to place (atoms) and cut them into balanced contiguous stages.

Atoms are modules in execution order. The search starts at the root's children and opens a module into its own
children only when it alone costs more than a stage's fair share (``total / partitions``), so a huge layer with
sub-layers is split while ordinary blocks stay whole (a module that is opened runs its own forward code on
every stage, so opening is kept to what balance needs). Stages are contiguous runs of atoms, which keeps the
activation traffic flowing one way and lets the 1F1B schedule run. The cut minimises the most expensive stage,
where an atom costs ``(1 - memory_weight) * compute share + memory_weight * memory share``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardkit.modelparallel.partitioning.trace import ModuleCost


@dataclass(frozen=True)
class Placement:
    """Which module runs on which stage, and each stage's estimated cost; ``print(placement)`` shows a table.

    ``stage_costs`` are the balanced quantity (compute and memory shares mixed by ``memory_weight``), as
    fractions of the whole model; ``stage_compute`` and ``stage_memory_bytes`` are the raw estimates.
    """

    partitions: int
    #: (module name, stage) in execution order.
    modules: tuple[tuple[str, int], ...]
    stage_costs: tuple[float, ...]
    stage_compute: tuple[float, ...]
    stage_memory_bytes: tuple[int, ...]
    memory_weight: float
    automatic: bool
    #: The device the trace ran on (smp's ``trace_device``, resolved).
    traced_on: str = "cpu"
    #: True when activation memory was measured (``trace_memory_usage``) rather than estimated.
    memory_measured: bool = False

    def stage_of(self, name: str) -> int:
        """The stage of a placed module."""
        for module, stage in self.modules:
            if module == name:
                return stage
        raise KeyError(f"module {name!r} is not in the placement; placed modules: {[m for m, _ in self.modules]}")

    def modules_on(self, stage: int) -> list[str]:
        """Names of the modules placed on ``stage``, in execution order."""
        return [name for name, s in self.modules if s == stage]

    @property
    def imbalance(self) -> float:
        """``(max - min) / max`` of the stage costs: 0 is perfectly balanced."""
        top = max(self.stage_costs)
        return (top - min(self.stage_costs)) / top if top > 0 else 0.0

    def __str__(self) -> str:
        kind = "auto" if self.automatic else "manual"
        memory = "measured" if self.memory_measured else "estimated"
        lines = [
            f"smp placement ({kind}, {self.partitions} stages, memory_weight={self.memory_weight:g}, traced on "
            f"{self.traced_on}, {memory} memory):"
        ]
        lines.append(f"  {'stage':>5}  {'cost':>6}  {'compute':>8}  {'memory':>10}  modules")
        total_compute = sum(self.stage_compute) or 1.0
        for stage in range(self.partitions):
            names = self.modules_on(stage)
            shown = ", ".join(names) if len(names) <= 8 else ", ".join(names[:4] + ["..."] + names[-3:])
            lines.append(
                f"  {stage:>5}  {self.stage_costs[stage]:>6.3f}  {self.stage_compute[stage] / total_compute:>7.1%}  "
                f"{self.stage_memory_bytes[stage] / 2**20:>7.2f}MiB  {shown or '(empty)'}"
            )
        return "\n".join(lines)


def _combined(costs: dict[str, ModuleCost], memory_weight: float, root: str = "") -> dict[str, float]:
    total_compute = costs[root].compute or 1.0
    total_memory = costs[root].memory_bytes or 1
    return {
        name: (1 - memory_weight) * c.compute / total_compute + memory_weight * c.memory_bytes / total_memory
        for name, c in costs.items()
    }


def select_atoms(
    costs: dict[str, ModuleCost], partitions: int, memory_weight: float, open_big: bool = True
) -> list[str]:
    """Modules to place, in execution order: the root's children, opening any that is bigger than a stage.

    A module is only opened when each of its children runs once per call of it (a child called at two places,
    like a shared dropout, could not sit on one stage between the others); ``open_big=False`` opens nothing
    but the root.
    """
    weight = _combined(costs, memory_weight)
    fair_share = weight[""] / partitions
    atoms: list[str] = []

    def called_children(name: str) -> list[str]:
        # A container that is never called itself (an nn.ModuleList) is looked through.
        found = []
        for child in costs[name].children:
            found += [child] if costs[child].order >= 0 else called_children(child)
        return found

    def visit(name: str, force_open: bool) -> None:
        cost = costs[name]
        called = sorted(called_children(name), key=lambda c: costs[c].order)
        own_compute = cost.compute - sum(costs[c].compute for c in called)
        # Opening runs the module's own code on every stage: only worth it when that code is a small part.
        mostly_children = cost.compute <= 0 or own_compute <= 0.5 * cost.compute
        called_once = all(costs[c].calls == cost.calls for c in called)
        big = open_big and weight[name] > fair_share and mostly_children and called_once
        if called and (force_open or big):
            for child in called:
                visit(child, False)
        else:
            atoms.append(name)

    visit("", partitions > 1)
    return atoms


def balanced_cut(weights: Sequence[float], partitions: int) -> list[int]:
    """Stage of each item: contiguous, non-decreasing, every stage non-empty when possible, max stage minimal.

    Example::

        assert balanced_cut([1, 1, 1, 3], 2) == [0, 0, 0, 1]
    """
    n = len(weights)
    if n == 0:
        return []
    if n <= partitions:
        return list(range(n))
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest possible max-stage cost putting the first i items on k stages (all non-empty).
    best = [[inf] * (n + 1) for _ in range(partitions + 1)]
    cut = [[0] * (n + 1) for _ in range(partitions + 1)]
    best[0][0] = 0.0
    for k in range(1, partitions + 1):
        for i in range(k, n - (partitions - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-15:
                    best[k][i], cut[k][i] = value, j
    stages = [0] * n
    i = n
    for k in range(partitions, 0, -1):
        j = cut[k][i]
        for item in range(j, i):
            stages[item] = k - 1
        i = j
    return stages


def auto_assignment(
    costs: dict[str, ModuleCost], partitions: int, memory_weight: float, open_big: bool = True
) -> dict[str, int]:
    """Stage of each atom (see :func:`select_atoms`) for a balanced pipeline."""
    atoms = select_atoms(costs, partitions, memory_weight, open_big)
    weight = _combined(costs, memory_weight)
    return dict(zip(atoms, balanced_cut([weight[a] for a in atoms], partitions)))


def describe(
    costs: dict[str, ModuleCost],
    units: dict[str, int],
    partitions: int,
    memory_weight: float,
    automatic: bool,
    traced_on: str = "cpu",
) -> Placement:
    """A :class:`Placement` for ``units`` (module name -> stage), with stage costs from the trace."""
    weight = _combined(costs, memory_weight)
    stage_costs = [0.0] * partitions
    compute = [0.0] * partitions
    memory = [0] * partitions
    for name, stage in units.items():
        cost = costs[name]
        stage_costs[stage] += weight[name]
        compute[stage] += cost.compute
        memory[stage] += cost.memory_bytes
    ordered = sorted(units.items(), key=lambda item: (costs[item[0]].order < 0, costs[item[0]].order, item[0]))
    measured = any(c.measured_bytes is not None for c in costs.values())
    return Placement(
        partitions,
        tuple(ordered),
        tuple(stage_costs),
        tuple(compute),
        tuple(memory),
        memory_weight,
        automatic,
        traced_on,
        measured,
    )
