"""There is one strategy registry: bench, the demo, the planner and the tests' builders all build through it.

Two kinds of check: the names each tool runs resolve to the very same registry entries (and the entries behave as
the tools rely on: defaults only when no options are given, a misspelt option refused before anything is built),
and an ``ast`` scan that the tools and the test libraries never call a strategy's wrapper constructor themselves,
while the registry's builders call every one of them (so the scan's list of constructors is not stale).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from shardkit.bench import multinode_measure
from shardkit.plan import strategies as plan_strategies
from shardkit.strategies import registry
from shardkit.strategies.registry import OptimizerSpec, OptionError

ROOT = Path(__file__).resolve().parents[1]
#: The constructors that make a model (or optimizer) into a data-parallel strategy, by the names code calls them.
WRAPPERS = {
    "DistributedDataParallel",
    "DDP",
    "OSS",
    "ShardedDataParallel",
    "FullyShardedDataParallel",
    "FSDP",
    "SlowMoDistributedDataParallel",
    "ZeroRedundancyOptimizer",
    "fully_shard",
}
#: Code that builds strategies by name: it must do so through the registry.
BUILDS_BY_NAME = [
    *sorted((ROOT / "src/shardkit/plan").glob("*.py")),
    ROOT / "src/shardkit/bench/zero.py",
    ROOT / "src/shardkit/bench/fsdp.py",
    ROOT / "src/shardkit/bench/multinode_measure.py",
    ROOT / "src/shardkit/bench/slowmo.py",
    ROOT / "src/shardkit/bench/plan_time_measure.py",
    ROOT / "src/shardkit/demo/train.py",
    ROOT / "src/shardkit/strategies/live.py",
    ROOT / "tests/reliability/rel_testlib.py",
    ROOT / "tests/reliability/any_to_any_lib.py",
    ROOT / "tests/reliability/universal_lib.py",
]


def wrapper_calls(path: Path) -> list[str]:
    """``name:line`` of every call of a :data:`WRAPPERS` constructor in ``path`` (``X(...)`` or ``mod.X(...)``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in WRAPPERS:
                found.append(f"{name}:{node.lineno}")
    return found


@pytest.mark.parametrize("path", BUILDS_BY_NAME, ids=lambda p: str(p.relative_to(ROOT)))
def test_tools_and_test_libraries_build_no_wrapper_themselves(path: Path) -> None:
    assert wrapper_calls(path) == [], f"{path.relative_to(ROOT)} builds a strategy by hand; use the registry"


def test_the_registry_builders_call_every_wrapper_the_scan_looks_for() -> None:
    called = {call.split(":")[0] for call in wrapper_calls(ROOT / "src/shardkit/strategies/builders.py")}
    assert called == WRAPPERS - {"DDP", "FSDP"}  # the aliases only tests wrote


def test_plan_bench_and_demo_names_are_the_same_registry_entries() -> None:
    for name, entry in plan_strategies.STRATEGIES.items():
        assert entry is registry.get_strategy(name)
    available, _ = registry.select()
    for entry in available:
        assert entry is registry.get_strategy(entry.name)
    for entry_name, _ in multinode_measure.ROWS.values():
        assert registry.get_strategy(entry_name) is not None
    # every registered strategy is either run side by side by bench/demo or named by the planner
    side_by_side = {s.name for s in registry.all_strategies()}
    assert set(registry.registered_names()) == side_by_side | set(plan_strategies.PLANNED)
    assert {"ddp", "oss_ddp", "oss_sdp", "fsdp"} <= side_by_side & set(plan_strategies.PLANNED)


def test_defaults_apply_only_when_no_options_are_given() -> None:
    seen = []

    def record(model, optim, group, options, topology):  # type: ignore[no-untyped-def]
        seen.append(options)
        return model, optim.make(model.parameters()), lambda: None

    entry = registry.Strategy("probe", "", record, defaults={"forward_prefetch": True})
    net = nn.Linear(2, 2)
    entry.build(net)
    entry.build(net, options={})
    entry.build(net, options={"reshard_after_forward": False})
    assert seen == [{"forward_prefetch": True}, {}, {"reshard_after_forward": False}]
    # bench runs shardkit FSDP with prefetch; the planner's {} is FSDP's own defaults (no prefetch)
    assert registry.get_strategy("fsdp").defaults == {"backward_prefetch": "BACKWARD_PRE", "forward_prefetch": True}


@pytest.mark.parametrize("name", registry.registered_names())
def test_a_misspelt_option_is_refused_before_anything_is_built_naming_the_valid_ones(name: str) -> None:
    strategy = registry.get_strategy(name)
    # No process group exists here: a builder that got past its check would fail with another error.
    # (a variant such as fsdp_no_reshard is named by its builder's strategy, fsdp)
    with pytest.raises(OptionError, match=r"strategy '\w+' has no option 'bogus'; its options are \w+"):
        strategy.build(nn.Linear(2, 2), OptimizerSpec(torch.optim.SGD, {"lr": 0.1}), options={"bogus": 1})
