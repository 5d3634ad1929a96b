"""``"virtual_stages": v`` (chunks in loop placement, interleaved 1F1B on a tick grid) trains exactly as one process,
and bad settings are refused on every rank before the first step."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import smp_testlib as lib
import torch
import torch.nn.functional as F
from smp_testlib import BUILDERS, batch, check_parity, parity_results, reference_run, smp_run, train_step
from torch import nn
from torch.distributed.pipelining import schedules as torch_schedules

import shardkit.modelparallel as smp
from shardkit.modelparallel.schedules.virtual_schedules import (
    ChunkAction,
    bubble_fraction,
    interleaved_grid,
    interleaved_schedule,
    placement,
    schedule_grid,
)
from shardkit.modelparallel.schedules.zbv import zbv_schedule
from shardkit.testing import run_distributed
from shardkit.testing.models import LMConfig, TransformerLM
from testkit import max_state_diff as max_diff
from testkit.smp import mse_step

V2 = {"pipeline": "interleaved", "virtual_stages": 2}
ZBV = {"pipeline": "zbv"}
DUALPIPEV = {"pipeline": "dualpipev"}  # ZBV's V and executor in DualPipeV's order (test_smp_dualpipev)


def _deep_lm() -> nn.Module:
    """Six blocks: enough places for the eight chunks of 4 ranks x 2 (the default LM has two)."""
    torch.manual_seed(2)
    return TransformerLM(LMConfig(n_layers=6))


BUILDERS.setdefault("lm6", _deep_lm)  # workers import this module to unpickle the test's function


def test_schedule_runs_every_action_once_in_dependency_order() -> None:
    for p, v, m in [(2, 2, 2), (2, 2, 8), (4, 2, 8), (2, 3, 4), (4, 3, 4)]:
        grid = interleaved_grid(p, v, m)
        seen: dict[tuple[str, int, int], int] = {}
        for t, row in enumerate(grid):
            for rank, action in enumerate(row):
                if action is not None:
                    assert action.chunk % p == rank
                    seen[(action.kind, action.chunk, action.microbatch)] = t
        assert len(seen) == 2 * p * v * m
        for (kind, c, k), t in seen.items():
            if kind == "F" and c > 0:
                assert seen[("F", c - 1, k)] < t
            if kind == "B":
                assert seen[("F", c, k)] < t
                if c < p * v - 1:
                    assert seen[("B", c + 1, k)] < t
    # The bubble of 1F1B, (p-1)/(m+p-1), divided by about v: (p-1)/(v*m+p-1) in ticks.
    assert bubble_fraction(interleaved_grid(2, 1, 8)) == pytest.approx(1 / 9)
    assert bubble_fraction(interleaved_grid(2, 2, 8)) == pytest.approx(1 / 17)


def test_rank_schedule_order() -> None:
    """Rounds of p micro-batches through each local chunk; backwards through the chunks in reverse."""
    assert interleaved_schedule(0, 2, 2, 2) == [
        ChunkAction("F", 0, 0),
        ChunkAction("F", 0, 1),
        ChunkAction("F", 2, 0),
        ChunkAction("F", 2, 1),
        ChunkAction("B", 2, 0),
        ChunkAction("B", 2, 1),
        ChunkAction("B", 0, 0),
        ChunkAction("B", 0, 1),
    ]


def test_two_ranks_two_chunks_match_single_process() -> None:
    cases = [
        ("mlp", {"partitions": 2, "microbatches": 4, **V2}, {}),
        ("mlp", {"partitions": 2, "microbatches": 2, **V2}, {}),
        # Cross-chunk residuals, one of them between the two chunks of rank 0; a glue parameter on every rank.
        ("residual", {"partitions": 2, "microbatches": 4, "auto_partition": False, **V2}, {"stages": 4}),
        ("lm", {"partitions": 2, "microbatches": 4, **V2}, {}),  # embedding tied to the head
        ("lm6", {"partitions": 2, "microbatches": 4, "pipeline": "interleaved", "virtual_stages": 3}, {}),
    ]
    check_parity(run_distributed(_parity_here, 2, cases))


def test_four_ranks_two_chunks_match_single_process() -> None:
    cases = [
        ("lm6", {"partitions": 4, "microbatches": 4, **V2}, {}),
        ("lm6", {"partitions": 4, "microbatches": 8, **V2}, {}),
        ("lm6", {"partitions": 4, "microbatches": 8, **ZBV}, {}),
        ("lm6", {"partitions": 4, "microbatches": 8, **DUALPIPEV}, {}),
    ]
    check_parity(run_distributed(_parity_here, 4, cases))


def test_data_parallel_replicas_match_single_process() -> None:
    """2 ranks x 2 chunks x 2 replicas; overlapped all-reduce in small buckets, and gradients as bucket views."""
    cases = [
        ("lm", {"partitions": 2, "microbatches": 4, "ddp": True, **V2}, {}),
        ("residual", {"partitions": 2, "microbatches": 2, "ddp": True, "auto_partition": False, **V2}, {"stages": 4}),
        # the overlapped all-reduce armed before DualPipeV's last W on each rank
        ("lm", {"partitions": 2, "microbatches": 4, "ddp": True, **DUALPIPEV}, {}),
    ]
    check_parity(run_distributed(_parity_here, 4, cases, {"bucket_cap_mb": 0.001}))
    check_parity(run_distributed(_parity_here, 4, cases[:1], {"gradient_as_bucket_view": True}))


def test_gradient_accumulation_over_steps_with_replicas() -> None:
    """backward_passes_per_step=2 under each chunked schedule (DualPipeV's and ZBV's fused B+W included): the
    gradients of two steps accumulate locally and are all-reduced once, after the second step's last backward."""
    cases = [("lm", {"partitions": 2, "microbatches": 4, "ddp": True, **keys}, {}) for keys in (V2, ZBV, DUALPIPEV)]
    check_parity(run_distributed(_parity_here, 4, cases, {"backward_passes_per_step": 2, "bucket_cap_mb": 0.01}))


def _parity_here(rank: int, world_size: int, cases: list[Any], options: Optional[dict[str, Any]] = None) -> Any:
    """The pipeline tests' parity run, started from this module so that the workers register ``lm6``."""
    return parity_results(rank, world_size, cases, options)


def _eval_and_placement(rank: int, world_size: int) -> dict[str, Any]:
    smp.init({"partitions": 2, "microbatches": 2, **V2})
    model = smp.DistributedModel(BUILDERS["mlp"]())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    x, y = batch("mlp", 8, 0)
    opt.zero_grad()
    losses = [train_step(model, "mlp", x, y).reduce_mean().item()]
    opt.step()

    @smp.step
    def predict(model: Any, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    small = batch("mlp", 4, 1)[0]  # shapes the first step never saw: discovered under no_grad
    with torch.no_grad():
        predicted = predict(model, small).concat()
    losses.append(train_step(model, "mlp", x, y).reduce_mean().item())  # training goes on after it
    state = model.state_dict()
    execution = model.stage_execution
    assert model.placement is not None and execution is not None
    out = {
        "chunks": model.placement.partitions,
        "virtual": type(execution).__name__,
        "my_chunks": sorted({s for _, s in model.placement.modules if s % 2 == rank}),
        "local_modules": sorted(n for n, _ in model.local_named_modules() if n),
        "placed": dict(model.placement.modules),
        "predicted": predicted,
        "losses": losses,
        "state": state,
    }
    smp.reset()
    return out


def test_placement_eval_with_new_shapes_and_training_after_it() -> None:
    ref = BUILDERS["mlp"]()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    x, y = batch("mlp", 8, 0)
    losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(ref(xs), ys) for xs, ys in zip(x.chunk(2), y.chunk(2))) / 2
        loss.backward()
        losses.append(loss.item())
        if len(losses) == 1:  # the smp run steps once, predicts, and computes one more loss
            opt.step()
            with torch.no_grad():
                expected = ref(batch("mlp", 4, 1)[0])
    for rank, r in enumerate(run_distributed(_eval_and_placement, 2)):
        assert r["chunks"] == 4 and r["virtual"] == "VirtualStageExecution", r
        assert r["my_chunks"] == [rank, rank + 2], r  # loop placement
        assert r["local_modules"] == sorted(n for n, s in r["placed"].items() if s % 2 == rank), r
        assert (r["predicted"] - expected).abs().max().item() <= 1e-6
        assert max(abs(a - b) for a, b in zip(r["losses"], losses)) <= 1e-5, (r["losses"], losses)
        assert max_diff(r["state"], ref.state_dict()) <= 1e-5


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"pipeline": "simple"}, r"runs the interleaved 1F1B schedule over the chunks, but pipeline='simple'"),
        ({"pipeline": "zero_bubble"}, r"set pipeline to 'interleaved' or virtual_stages to 1"),
        ({"microbatches": 3}, r"microbatches \(3\) must be a multiple of 2"),
        ({"partitions": 1}, r"needs partitions >= 2"),
        ({"virtual_stages": 0}, r"'virtual_stages' must be >= 1"),
        ({"default_partition": 4}, r"default_partition=4 must be smaller than partitions=2 x virtual_stages"),
        ({"pipeline": "zbv", "microbatches": 3}, r"'zbv' needs at least 2 x partitions = 4 micro-batches"),
        ({"pipeline": "zbv", "virtual_stages": 3}, r"'zbv' places exactly two chunks per rank"),
    ],
)
def test_bad_config_is_refused(extra: dict[str, Any], message: str) -> None:
    config = {"partitions": 2, "microbatches": 4, **V2, **extra}
    with pytest.raises(ValueError, match=message):
        smp.ModelParallelConfig.from_dict(config)


def test_config_key_as_a_string_and_the_default_micro_batches() -> None:
    cfg = smp.ModelParallelConfig.from_dict({"partitions": "2", "microbatches": "4", "virtual_stages": "3"})
    assert (cfg.virtual_stages, cfg.chunks) == (3, 6)
    with pytest.raises(ValueError, match=r"microbatches \(1\) must be a multiple of 2; use e.g. microbatches=2"):
        smp.ModelParallelConfig.from_dict({"partitions": 2, "virtual_stages": 2})


def _too_many_chunks(rank: int, world_size: int) -> str:
    smp.init({"partitions": 2, "microbatches": 2, "pipeline": "interleaved", "virtual_stages": 4})
    model = smp.DistributedModel(BUILDERS["mlp"]())  # seven modules for eight chunks
    x, y = batch("mlp", 8, 0)
    try:
        train_step(model, "mlp", x, y)
    except (RuntimeError, ValueError) as exc:  # rank 0 raises the partitioner's error, the others its report
        return str(exc)
    finally:
        smp.reset()
    return "no error"


def test_more_chunks_than_modules_is_refused_on_every_rank() -> None:
    for message in run_distributed(_too_many_chunks, 2):
        assert "needs 8 chunks, but the model has only 7" in message and "lower virtual_stages" in message, message


def test_zbv_schedule_places_chunks_in_a_v_and_splits_every_backward() -> None:
    assert placement("zbv", 4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    for p, m in [(2, 4), (2, 8), (4, 8)]:
        grid = schedule_grid("zbv", p, 2, m)
        ran = [a for row in grid for a in row if a is not None]
        assert sorted(ran) == sorted(ChunkAction(k, c, mb) for k in "FBW" for c in range(2 * p) for mb in range(m))
        for rank in range(p):
            mine = [row[rank] for row in grid if row[rank] is not None]
            held = peak = 0
            for a in mine:
                assert a is not None and placement("zbv", p, 2)[a.chunk] == rank
                held += {"F": 1, "B": 0, "W": -1}[a.kind]
                peak = max(peak, held)
            assert peak <= 2 * p  # 1F1B's activation memory: p micro-batches of two chunks
    # Smaller than interleaved 1F1B's bubble over the same chunks (ticks: F, B and W one each).
    assert bubble_fraction(schedule_grid("zbv", 2, 2, 8)) < 0.5 * bubble_fraction(interleaved_grid(2, 2, 8))


@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (3, 6), (4, 9), (6, 20)])
def test_zbv_is_torchs_zbv_order(p: int, m: int) -> None:
    """torch's ScheduleZBVZeroBubble lists (input- and weight-gradient actions as B and W) are ours, and their
    grid idles as DualPipeV's: (p - 1) / (6m + p - 1)."""
    cls = getattr(torch_schedules, "ScheduleZBVZeroBubble", None)
    if cls is None:
        pytest.skip("this torch has no ScheduleZBVZeroBubble")
    kinds = torch_schedules._ComputationType
    names = {kinds.FORWARD: "F", kinds.BACKWARD_INPUT: "B", kinds.BACKWARD_WEIGHT: "W"}

    class _Shape:  # what the list builder reads of a schedule object
        pp_group_size = p
        num_stages = 2 * p
        _n_microbatches = m

    for rank in range(p):
        ops = cls._calculate_single_rank_operations(_Shape(), rank)
        theirs = [ChunkAction(names[a.computation_type], a.stage_index, a.microbatch_index) for a in ops if a]
        assert theirs == zbv_schedule(rank, p, m), rank
    assert bubble_fraction(schedule_grid("zbv", p, 2, m)) == pytest.approx((p - 1) / (6 * m + p - 1))


def test_zbv_two_ranks_match_single_process() -> None:
    """ZBV, and DualPipeV on the same V, train as one process."""
    cases = [
        ("mlp", {"partitions": 2, "microbatches": 4, **ZBV}, {}),
        ("residual", {"partitions": 2, "microbatches": 4, "auto_partition": False, **ZBV}, {"stages": 4}),
        ("lm", {"partitions": 2, "microbatches": 8, **ZBV}, {}),  # loss and embedding both on rank 0
        ("residual", {"partitions": 2, "microbatches": 8, "auto_partition": False, **DUALPIPEV}, {"stages": 4}),
        ("lm", {"partitions": 2, "microbatches": 4, **DUALPIPEV}, {}),  # m = 2p; the tied embedding and head on rank 0
    ]
    check_parity(run_distributed(_parity_here, 2, cases))


def _zbv_replicas(rank: int, world_size: int) -> dict[str, Any]:
    """2 ranks x 2 replicas; the overlapped all-reduce in small buckets has to see every W."""
    config = {"partitions": 2, "microbatches": 4, "ddp": True, **ZBV}
    ref_losses, ref_state = reference_run("lm", 3, 8, replicas=2)
    losses, state, model = smp_run("lm", config, 3, 8, bucket_cap_mb=0.001)
    execution = model.stage_execution
    assert execution is not None
    out = {
        "loss_diff": max(abs(a - b[smp.dp_rank()]) for a, b in zip(losses, ref_losses)),
        "param_diff": max_diff(state, ref_state),
        "unsplit": execution.unsplit_reason,
        "output_rank": execution.output_stage,
    }
    smp.reset()
    return out


def test_zbv_data_parallel_replicas_match_single_process() -> None:
    for r in run_distributed(_zbv_replicas, 4):
        assert r["loss_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, r
        assert r["unsplit"] is None, r  # every backward really was split into B and W
        assert r["output_rank"] == 0, r  # the V's last chunk is on the first rank


def _checkpointed_chunks(rank: int, world_size: int, pipeline_keys: dict[str, Any]) -> dict[str, Any]:
    mbs = lib.CKPT_MICROBATCHES * 2
    smp.init({"partitions": 2, "microbatches": mbs, **pipeline_keys})
    net = lib.CkptNet(manual=False)
    calls = [0] * len(net.blocks)
    for i, block in enumerate(net.blocks):
        smp.set_activation_checkpointing(block)
        block.lin.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    losses: list[float] = []
    for s in range(lib.CKPT_STEPS):
        x, y = lib.ckpt_batch(s)
        opt.zero_grad()
        losses.append(mse_step(model, x, y).reduce_mean().item())
        opt.step()
        if s == 0:  # the first step also traced: count the later ones
            calls = [0] * len(calls)
    smp.reset()
    return {"losses": losses, "per_microbatch": [c / ((lib.CKPT_STEPS - 1) * mbs) for c in calls]}


@pytest.mark.parametrize("pipeline_keys", [V2, ZBV, DUALPIPEV], ids=["virtual_stages", "zbv", "dualpipev"])
def test_activation_checkpointed_blocks_in_chunks(pipeline_keys: dict[str, Any]) -> None:
    """Blocks given to smp.set_activation_checkpointing recompute inside their chunk's backward (under ZBV and
    DualPipeV that chunk's backward runs unsplit, with the documented warning, where it is not run whole anyway):
    training is unchanged."""
    torch.manual_seed(0)
    model = lib.CkptNet(manual=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = []
    for s in range(lib.CKPT_STEPS):
        x, y = lib.ckpt_batch(s)
        opt.zero_grad()
        mbs = lib.CKPT_MICROBATCHES * 2
        loss = sum(F.mse_loss(model(a), b) for a, b in zip(x.chunk(mbs), y.chunk(mbs))) / mbs
        loss.backward()
        opt.step()
        reference.append(loss.item())
    results = run_distributed(_checkpointed_chunks, 2, pipeline_keys)
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["losses"], reference)) <= 1e-5, (r["losses"], reference)
    # Each block's layer runs once in its chunk's forward and once more in its backward, on its rank only.
    assert [sum(c) for c in zip(*(r["per_microbatch"] for r in results))] == [2.0] * 4, results


def _checkpoints_in_chunks(rank: int, world_size: int, directory: str, keys: dict[str, Any]) -> dict[str, Any]:
    return lib.checkpoint_round_trips(rank, world_size, directory, {"partitions": 2, "microbatches": 2, **keys})


@pytest.mark.parametrize(
    "keys",
    [{"microbatches": 2, **V2}, {"microbatches": 4, **ZBV}, {"microbatches": 4, **DUALPIPEV}],
    ids=["virtual_stages", "zbv", "dualpipev"],
)
def test_partial_and_full_checkpoints_with_chunks(tmp_path: Any, keys: dict[str, Any]) -> None:
    """Save partial (per rank, both chunks) and full checkpoints, load them into a fresh model: training goes on
    identically; the full one is a plain torch checkpoint."""
    for r in run_distributed(_checkpoints_in_chunks, 2, str(tmp_path), keys):
        assert r["files"] == ["full.pt", "partial.pt_0", "partial.pt_1"]
        assert r["held"] < r["total"]
        for key in ("partial", "full", "plain"):
            assert r[f"{key}_loss_diff"] <= 1e-6, (key, r)
            assert r[f"{key}_out_diff"] <= 1e-5, (key, r)
        for key in ("partial", "full"):
            assert r[f"{key}_param_diff"] <= 1e-6, (key, r)


def _scaled(rank: int, world_size: int, keys: dict[str, Any]) -> list[tuple[float, bool]]:
    """Two steps under smp.amp.GradScaler; in the first only rank 0's gradients overflow."""
    smp.init({"partitions": 2, "microbatches": 4, **keys})
    model = smp.DistributedModel(BUILDERS["mlp"]())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = smp.amp.GradScaler(init_scale=256.0)

    @smp.step
    def step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(scaler.scale(loss))
        return loss

    out = []
    for s in range(2):
        x, y = batch("mlp", 8, s)
        opt.zero_grad()
        step(model, x, y)
        local = list(model.local_parameters())
        if s == 0 and rank == 0:
            local[-1].grad.view(-1)[0] = float("inf")  # a parameter of rank 0's second chunk
        before = [p.detach().clone() for p in local]
        scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale(), any(not torch.equal(a, p) for a, p in zip(before, local))))
    smp.reset()
    return out


@pytest.mark.parametrize("keys", [V2, ZBV, DUALPIPEV], ids=["virtual_stages", "zbv", "dualpipev"])
def test_grad_scaler_skips_the_step_on_every_rank(keys: dict[str, Any]) -> None:
    """An overflow in one chunk's gradients skips the step on every rank (and the scale halves once)."""
    for per_rank in run_distributed(_scaled, 2, keys):
        assert per_rank == [(128.0, False), (128.0, True)]


def _v_peaks(rank: int, world_size: int) -> dict[str, list[int]]:
    """Per V schedule and micro-batch count, this rank's peak bytes saved for backward over one step."""
    peaks: dict[str, list[int]] = {}
    for keys in (ZBV, DUALPIPEV):
        for m in (2 * world_size, 4 * world_size):
            smp.init({"partitions": world_size, "microbatches": m, **keys})
            model = smp.DistributedModel(_deep_lm())
            x, y = batch("lm", 2 * m, 0)
            train_step(model, "lm", x, y)  # partitions the model
            execution = model.stage_execution
            assert execution is not None
            execution.measure_activations = True
            execution.activations.reset_peak()
            train_step(model, "lm", x, y)
            peaks.setdefault(keys["pipeline"], []).append(execution.activations.saved.peak)
            smp.reset()
    return peaks


def test_v_schedules_hold_no_more_activations_with_more_microbatches() -> None:
    """A V schedule caps the chunk-micro-batches a rank holds from F to W, whatever ``m``: twice the micro-batches
    (each as large) must not raise a rank's peak. The rank holding the output chunk kept every micro-batch's
    graph under the returned loss until the step's end (the peak grew with ``m``)."""
    for rank, per_schedule in enumerate(run_distributed(_v_peaks, 2)):
        for pipeline, (fewer, more) in per_schedule.items():
            assert 0 < more <= fewer * 1.02, (rank, pipeline, fewer, more)
