"""Any strategy's checkpoint loads into any other strategy at any world size, and training continues as if it had
never stopped.

Every family of :mod:`any_to_any_lib` trains ``SAVE_AT`` steps at each of its world sizes and saves (three jobs,
one per world size). Then one job per target world size builds, for each case, a fresh model of the target family
from another seed, loads a checkpoint of the source family, and trains on. Every ordered pair of families is a
case, and the world sizes rotate so that each (family, world size) is a source and a target: the loaded state must
equal the single-process run after ``SAVE_AT`` steps and the continued state the single-process run after
``TOTAL`` steps (within fp32 reduction-order tolerances). A checkpoint of FSDP with mixed precision must carry the
FP32 master parameters.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from any_to_any_lib import FAMILY_SIZES, TWO_NODES, build, full_state, reference, release, train

from shardkit.checkpoint import load_checkpoint, save_checkpoint
from shardkit.testing import run_distributed
from testkit import state_difference

SAVE_AT, TOTAL = 2, 4
SIZES = (1, 2, 4)
MIXED = ("fsdp_nested", 2)  # the mixed-precision source: family and world size


class Case(NamedTuple):
    source: str
    source_size: int
    target: str
    target_size: int
    #: Train the target one step before loading (smp and FSDP then load into a partitioned / initialised model).
    warm: bool

    @property
    def name(self) -> str:
        return f"{self.source}@{self.source_size}->{self.target}@{self.target_size}{'-warm' if self.warm else ''}"


def _cases() -> list[Case]:
    families = list(FAMILY_SIZES)
    cases = []
    for (i, source), (j, target) in itertools.product(enumerate(families), enumerate(families)):
        a = FAMILY_SIZES[source][j % len(FAMILY_SIZES[source])]  # each source cycles through its sizes ...
        b = FAMILY_SIZES[target][(i + j) % len(FAMILY_SIZES[target])]  # ... and each target through its own
        cases.append(Case(source, a, target, b, warm=target in ("smp", "fsdp_nested") and i % 2 == 1))
    return cases


#: Beyond the pairs: four pipeline stages, and hybrid-sharded FSDP with CPU offload (world size 4 runs as two
#: simulated nodes of two processes).
EXTRA_CASES = [
    Case("smp_p4", 4, "fsdp_noflat", 2, warm=False),
    Case("oss_sdp", 2, "smp_p4", 4, warm=True),
    Case("fsdp_hybrid", 4, "smp", 2, warm=False),
    Case("ddp", 2, "fsdp_hybrid", 4, warm=True),
]
EXTRA_SIZES = {"smp_p4": 4, "fsdp_hybrid": 4}
CASES = _cases() + EXTRA_CASES
#: The strategy name each family's checkpoint records.
STRATEGY_NAMES = {
    "plain": "plain",
    "ddp": "ddp",
    "oss": "oss",
    "oss_sdp": "oss_sdp",
    "fsdp_nested": "fsdp",
    "fsdp_noflat": "fsdp",
    "smp": "smp",
    "slowmo": "slowmo",
    "smp_p4": "smp",
    "fsdp_hybrid": "fsdp",
}
#: Targets of the mixed-precision checkpoint; "+mixed": the target runs mixed precision too, warmed by one step so
#: its buffers are already cast (the checkpoint's float32 buffer is cast back on load).
MIXED_TARGETS = (("plain", 1), ("smp", 4), ("fsdp_nested+mixed", 4))


def _directory(root: str, family: str, size: int, mixed: bool = False) -> Path:
    return Path(root) / f"{family}{'-mixed' if mixed else ''}-w{size}"


def _save_every_family(rank: int, world_size: int, root: str) -> dict[str, Any]:
    saved: dict[str, Any] = {}
    plans = [(family, False) for family, sizes in FAMILY_SIZES.items() if world_size in sizes]
    plans += [(family, False) for family, size in EXTRA_SIZES.items() if size == world_size]
    if world_size == MIXED[1]:
        plans.append((MIXED[0], True))
    for family, mixed in plans:
        run = build(family, rank, world_size, seed=0, mixed_precision=mixed)
        train(run, range(SAVE_AT))
        save_checkpoint(
            _directory(root, family, world_size, mixed), step=SAVE_AT - 1, model=run.model, optimizer=run.optimizer
        )
        if mixed:
            saved["mixed"] = {k: v.numpy() for k, v in full_state(run).items()}
        release(run)
    return saved


def _load_cases(rank: int, world_size: int, root: str, cases: list[Case]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in cases:
        target, _, mixed_target = case.target.partition("+")
        run = build(target, rank, world_size, seed=1, mixed_precision=bool(mixed_target))
        if case.warm:
            train(run, range(1))
        mixed = case.source == "mixed"
        source = MIXED[0] if mixed else case.source
        info = load_checkpoint(
            _directory(root, source, case.source_size, mixed), model=run.model, optimizer=run.optimizer
        )
        loaded = full_state(run)
        if not mixed:
            train(run, range(info.step + 1, TOTAL))
        final = full_state(run)
        release(run)
        out[case.name] = {
            "loaded": {k: v.numpy() for k, v in loaded.items()},
            "final": {k: v.numpy() for k, v in final.items()},
            "info": (info.step, info.world_size, info.strategy),
        }
    return out


@pytest.fixture(scope="module")
def moved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("any_to_any"))
    started = time.perf_counter()
    saved: dict[str, Any] = {}
    for size in SIZES:
        env = TWO_NODES if size == 4 else None
        saved.update(run_distributed(_save_every_family, size, root, timeout_s=170, rank_env=env)[0])
    mixed_cases = [Case("mixed", MIXED[1], t, size, warm=t.endswith("+mixed")) for t, size in MIXED_TARGETS]
    results: dict[str, Any] = {}
    for size in SIZES:
        mine = [c for c in CASES + mixed_cases if c.target_size == size]
        env = TWO_NODES if size == 4 else None
        for rank_result in run_distributed(_load_cases, size, root, mine, timeout_s=170, rank_env=env):
            for name, value in rank_result.items():
                results.setdefault(name, []).append(value)
    print(f"any-to-any: {len(CASES) + len(mixed_cases)} moves in {time.perf_counter() - started:.1f} s")
    layouts = {path.name: json.loads((path / "meta.json").read_text())["layout"] for path in Path(root).iterdir()}
    return {
        "results": results,
        "mixed": saved["mixed"],
        "layouts": layouts,
        "ref_saved": reference(SAVE_AT),
        "ref_final": reference(TOTAL),
    }


def _tensors(arrays: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


def test_every_family_saves_the_universal_layout(moved: dict[str, Any]) -> None:
    expected = {_directory("", f, s).name for f, sizes in FAMILY_SIZES.items() for s in sizes}
    expected |= {_directory("", f, s).name for f, s in EXTRA_SIZES.items()}
    assert set(moved["layouts"]) == expected | {_directory("", *MIXED, mixed=True).name}
    assert set(moved["layouts"].values()) == {"universal"}


def test_cases_cover_every_pair_and_every_world_size_both_ways() -> None:
    families = set(FAMILY_SIZES)
    pairs = CASES[: len(CASES) - len(EXTRA_CASES)]
    assert {(c.source, c.target) for c in pairs} == set(itertools.product(families, families))
    assert {(c.source, c.source_size) for c in pairs} == {(f, s) for f in families for s in FAMILY_SIZES[f]}
    assert {(c.target, c.target_size) for c in pairs} == {(f, s) for f in families for s in FAMILY_SIZES[f]}
    assert any(c.warm and c.target == "smp" for c in CASES) and any(not c.warm and c.target == "smp" for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_checkpoint_moves_between_strategies_and_training_continues(moved: dict[str, Any], case: Case) -> None:
    per_rank = moved["results"][case.name]
    assert len(per_rank) == case.target_size
    for rank, result in enumerate(per_rank):
        assert result["info"] == (SAVE_AT - 1, case.source_size, STRATEGY_NAMES[case.source])
        gap = state_difference(moved["ref_saved"], _tensors(result["loaded"]))
        assert gap is None, f"rank {rank}, right after loading: {gap}"
        gap = state_difference(moved["ref_final"], _tensors(result["final"]))
        assert gap is None, f"rank {rank}, after training on: {gap}"


@pytest.mark.parametrize("target", MIXED_TARGETS, ids=[f"{t}@{s}" for t, s in MIXED_TARGETS])
def test_mixed_precision_fsdp_checkpoint_holds_the_fp32_master_parameters(
    moved: dict[str, Any], target: tuple[str, int]
) -> None:
    name = Case("mixed", MIXED[1], target[0], target[1], warm=target[0].endswith("+mixed")).name
    master = _tensors(moved["mixed"])
    assert all(v.dtype == torch.float64 for v in master.values())
    for rank, result in enumerate(moved["results"][name]):
        gap = state_difference(master, _tensors(result["loaded"]), rtol=0.0, atol=0.0)
        assert gap is None, f"rank {rank}: {gap}"
