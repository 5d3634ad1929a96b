"""shardkit.checkpoint under every strategy: save mid-run, resume in a fresh model, continue bitwise-identically;
OSS and FSDP checkpoints load at another world size; ShardedGradScaler skips an overflowing step on every rank.

One 2-rank job trains every strategy (saving the cost of a job per strategy); each test checks its own part.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from rel_testlib import (
    STRATEGIES,
    Run,
    as_numpy,
    build,
    fsdp_model,
    full_state,
    release,
    stored_tensors,
    tiny_net,
    train,
)

from shardkit.checkpoint import (
    load_checkpoint,
    save_checkpoint,
    step_directory,
)
from shardkit.distributed import DummyProcessGroup
from shardkit.nn import ShardedDataParallel
from shardkit.optim import OSS, ShardedGradScaler
from shardkit.testing import run_distributed
from testkit import bitwise_difference

SAVE_AT, TOTAL = 2, 5
POISON = (SAVE_AT, 1)  # oss_sdp: rank 1's batch overflows at the step before the save


def _round_trip(rank: int, strategy: str, root: Path) -> dict[str, Any]:
    run = build(strategy, seed=0)
    poison = POISON if strategy == "oss_sdp" else None
    train(run, range(SAVE_AT), rank)
    before_poison = full_state(run)
    train(run, range(SAVE_AT, SAVE_AT + 1), rank, poison_at=poison)
    saved = full_state(run)
    out: dict[str, Any] = {"skipped": bitwise_difference(before_poison, saved) is None, "saved": as_numpy(saved)}
    if run.scaler is not None:
        out["scale"] = run.scaler.get_scale()
    save_checkpoint(
        step_directory(root, SAVE_AT),
        step=SAVE_AT,
        model=run.model,
        optimizer=run.optimizer,
        scaler=run.scaler,
        data_position={"rank": rank},
        extra={"strategy": strategy},
    )
    train(run, range(SAVE_AT + 1, TOTAL), rank)
    expected = full_state(run)
    release(run)

    fresh = build(strategy, seed=1)  # other weights and RNG: only the checkpoint can make it match
    info = load_checkpoint(root, model=fresh.model, optimizer=fresh.optimizer, scaler=fresh.scaler)
    if fresh.scaler is not None:
        out["loaded_scale"] = fresh.scaler.get_scale()
    train(fresh, range(info.step + 1, TOTAL), rank)
    out["diff"] = bitwise_difference(expected, full_state(fresh))
    out["info"] = (info.step, info.strategy, info.world_size, info.data_position, info.extra, info.rng_restored)
    release(fresh)
    return out


def _every_strategy(rank: int, world_size: int, root: str) -> dict[str, Any]:
    return {strategy: _round_trip(rank, strategy, Path(root) / strategy) for strategy in STRATEGIES}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("strategies")
    return root, run_distributed(_every_strategy, 2, str(root), timeout_s=120)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_continues_bitwise_identically(trained: tuple[Path, list[dict[str, Any]]], strategy: str) -> None:
    _, results = trained
    for rank, result in enumerate(results):
        mine = result[strategy]
        assert mine["diff"] is None, f"rank {rank}: {mine['diff']}"
        assert mine["info"] == (SAVE_AT, strategy, 2, {"rank": rank}, {"strategy": strategy}, True)


def test_sharded_grad_scaler_skips_an_overflow_on_every_rank_and_the_checkpoint_keeps_the_scale(
    trained: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = trained
    sdp = [result["oss_sdp"] for result in results]
    # Only rank 1 saw the inf, yet both ranks skipped the step and backed off the scale together.
    assert [r["skipped"] for r in sdp] == [True, True]
    assert [r["scale"] for r in sdp] == [2.0**9, 2.0**9]
    assert [r["loaded_scale"] for r in sdp] == [2.0**9, 2.0**9]
    assert bitwise_difference(_tensors(sdp[0]["saved"]), _tensors(sdp[1]["saved"])) is None


def _tensors(arrays: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


def test_oss_checkpoint_from_two_ranks_loads_in_one_process(trained: tuple[Path, list[dict[str, Any]]]) -> None:
    root, results = trained
    net = tiny_net(seed=3)
    opt = OSS(net.parameters(), optim=torch.optim.Adam, group=DummyProcessGroup(rank=0, size=1), lr=0.01)
    model = ShardedDataParallel(net, opt)
    info = load_checkpoint(root / "oss_sdp", model=model, optimizer=opt, scaler=ShardedGradScaler())
    assert (info.world_size, info.rng_restored, info.data_position) == (2, False, {"rank": 0})
    assert bitwise_difference(_tensors(results[0]["oss_sdp"]["saved"]), full_state(Run("oss_sdp", model, opt))) is None
    stored = stored_tensors(step_directory(root / "oss_sdp", SAVE_AT))
    assert set(opt.optim.state) == set(net.parameters())  # one rank now owns the whole state
    for name, p in net.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.optim.state[p][key], stored[f"optim/{name}/{key}"])


def test_fsdp_checkpoint_from_two_ranks_loads_in_one_process(trained: tuple[Path, list[dict[str, Any]]]) -> None:
    root, results = trained
    model = fsdp_model(seed=3, group=DummyProcessGroup(rank=0, size=1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    info = load_checkpoint(root / "fsdp", model=model, optimizer=opt)
    assert info.world_size == 2
    assert (
        bitwise_difference(_tensors(results[0]["fsdp"]["saved"]), {k: v for k, v in model.state_dict().items()}) is None
    )
    stored = stored_tensors(step_directory(root / "fsdp", SAVE_AT))
    here = model.gather_full_optim_state_dict(opt)
    names = [name for name, _ in tiny_net(seed=3).named_parameters()]
    for pid, state in here["state"].items():
        for key, value in state.items():
            assert torch.equal(value.reshape(-1), stored[f"optim/{names[pid]}/{key}"].reshape(-1)), (pid, key)


def _slowmo_at_one_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    run = build("slowmo", seed=0)
    info = load_checkpoint(Path(root) / "slowmo", model=run.model, optimizer=run.optimizer)
    params = {k: v.detach().double().numpy() for k, v in run.model.module.state_dict().items()}
    return {"rng_restored": info.rng_restored, "params": params, "weight": run.model.push_sum_state.weight}


def test_slowmo_checkpoint_loads_its_average_at_another_world_size(
    trained: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, results = trained
    [loaded] = run_distributed(_slowmo_at_one_rank, 1, str(root), timeout_s=60)
    assert loaded["rng_restored"] is False and loaded["weight"] == 1.0
    # SGP: each rank saved numerators x_r and a push-sum weight w_r; the portable state is sum(x) / sum(w).
    saved = [_tensors(result["slowmo"]["saved"]) for result in results]
    weights = sum(float(state["ps_weight"]) for state in saved)
    for key, value in loaded["params"].items():
        average = sum(state[f"module.{key}"].double() for state in saved) / weights
        assert torch.allclose(torch.from_numpy(value), average, rtol=1e-5, atol=1e-6), key
