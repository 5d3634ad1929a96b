"""gpu-check part ``ranks2``: two ranks, in the form this machine allows (:func:`~.settings.rank_form`).

Two GPUs or more: one rank per GPU over NCCL, each rank's device chosen by shardkit itself (``LOCAL_RANK``; no
worker calls ``set_device``), so NCCL's collectives, its object collectives and shardkit's device choice all run.
One GPU: both ranks share it over gloo (NCCL refuses that), and the JSON says what that leaves untested.

Checks, each agreed over both ranks and recorded by rank 0 as it finishes: where each rank computes; DDP, OSS +
ShardedDataParallel and FSDP against one process on both ranks' batches; the fp16 scalers with an inf
on rank 1 only (rank 0 must skip too); the asynchronous sharded checkpoint changed in place after the save.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardkit.bench.gpu_check import parts_amp, parts_checkpoint
from shardkit.bench.gpu_check.common import (
    PartContext,
    batches,
    build_lm,
    device,
    host_params,
    max_diff,
    small_lm,
    train,
)
from shardkit.bench.gpu_check.results import Outcome, Results, at_most

#: shardkit's sharded strategies and the DDP baseline (torch FSDP2 is left out: on one GPU the ranks talk gloo,
#: whose lack of CUDA all-gather would be torch's finding, not shardkit's).
STRATEGIES = ("ddp", "oss_sdp", "fsdp")
#: Largest parameter difference of two ranks' training to one process on both ranks' batches (fp32).
TWO_RANK_TOLERANCE = 1e-4


def agreed_check(res: Any, name: str, run: Callable[[], Any], judge: Callable[[list[Any]], Outcome]) -> None:
    """Run ``run`` on every rank, gather what each found (or its error), and let rank 0 record the verdict."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.distributed.objects import all_gather_objects

    start = time.perf_counter()
    try:
        found: tuple[str, Any] = ("ok", run())
    except Exception as err:  # sent to rank 0 as the finding; the peers' collectives may then time out
        found = ("error", f"{type(err).__name__}: {err}"[:2000])
    secs = round(time.perf_counter() - start, 2)
    per_rank = all_gather_objects(found, None, f"gpu_check {name}")
    if res is None:
        return
    errors = [f"rank {r}: {value}" for r, (tag, value) in enumerate(per_rank) if tag == "error"]
    if errors:
        res.check(name, lambda: Outcome(False, None, "every rank runs it", "; ".join(errors)))
    else:
        res.check(name, lambda: judge([value for _, value in per_rank]))
    res.checks[name]["secs"] = secs  # the ranks' time, not the judging
    res.flush()


def _strategy_params(name: str, small: bool, rank: int) -> dict[str, Any]:
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.strategies.registry import OptimizerSpec, get_strategy

    cfg = small_lm(small)
    spec = OptimizerSpec(torch.optim.SGD, {"lr": 0.05})
    model, optimizer, after = get_strategy(name).build(build_lm(cfg, device()), spec, dist.group.WORLD)
    train(model, optimizer, batches(cfg, 2, 4, seed=100 + 10 * rank), after_step=after)
    return host_params(model)


def _one_process_on_both(small: bool) -> dict[str, torch.Tensor]:
    cfg = small_lm(small)
    pairs = zip(batches(cfg, 2, 4, seed=100), batches(cfg, 2, 4, seed=110))
    full = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in pairs]
    ref = build_lm(cfg, device())
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.05), full)
    return host_params(ref)


def ranks_worker(rank: int, world_size: int, small: bool, record: str, multi_gpu: bool) -> None:
    """Every two-rank check, in the same order on both ranks; rank 0 writes the records."""
    res = Results("ranks2", Path(record), resume=True) if rank == 0 else None
    where = device()

    def placement(per_rank: list[Any]) -> Outcome:
        want = ["cuda:0", "cuda:1"] if multi_gpu and where.type == "cuda" else [str(where)] * 2
        return Outcome(per_rank == want, per_rank, want, "" if per_rank == want else "ranks computed elsewhere")

    agreed_check(res, "ranks2:device_choice", lambda: str(device()), placement)
    reference = _one_process_on_both(small)

    def parity(per_rank: list[Any]) -> Outcome:
        gap = max(max_diff(params, reference) for params in per_rank)
        return at_most(gap, TWO_RANK_TOLERANCE, "largest parameter gap to one process on both ranks' batches")

    for name in STRATEGIES:
        agreed_check(res, f"ranks2:{name}", lambda n=name: _strategy_params(n, small, rank), parity)  # type: ignore[misc]
    for name, run in parts_amp.scaler_cases(small, poison_rank=1, smp_partitions=2):
        agreed_check(res, f"ranks2:{name}", run, parts_amp.judge)
    root = Path(tempfile.mkdtemp(prefix="gpu_check_ckpt2_")) if rank == 0 else None
    from shardkit.distributed.objects import broadcast_object

    shared = Path(broadcast_object(str(root), 0, None, "gpu_check checkpoint folder"))
    try:
        run = lambda: parts_checkpoint.async_checkpoint_case(small, shared / "ws2", 0.5 if small else 3.0)  # noqa: E731
        agreed_check(res, "ranks2:checkpoint:async_fsdp_adamw_changed_after_return", run, parts_checkpoint.judge)
    finally:
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)


def run_ranks(
    res: Results, ctx: PartContext, worker: Callable[..., None], args: tuple[Any, ...], expected: list[str]
) -> None:
    """Run ``worker(rank, 2, *args)`` on two ranks in this machine's form (rank 0 adds its records to this part's
    file); then record whether the ranks finished, and fail each ``expected`` check they never reached."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.testing import run_distributed

    form = ctx.form()
    res.check(f"{res.part}:form", lambda: Outcome(True, {"backend": form.backend, "label": form.label}, "recorded"))
    error = ""
    try:  # rank 0 adds its records to this part's file meanwhile: nothing is written here until it is done
        run_distributed(worker, 2, *args, timeout_s=ctx.rank_timeout(), backend=form.backend)
    except Exception as err:  # a rank's error or hang (with its stack), recorded below
        error = f"{type(err).__name__}: {err}"[:20000]
    res.reload()
    res.check(
        f"{res.part}:ranks_finished", lambda: Outcome(not error, form.backend, "both ranks finish every check", error)
    )
    for name in expected:
        if name not in res.checks:
            res.record(
                name,
                {
                    "verdict": "fail",
                    "why": "not reached: the ranks stopped before it",
                    "value": None,
                    "threshold": None,
                    "secs": 0.0,
                },
            )


def part_ranks2(res: Results, ctx: PartContext) -> None:
    """The two-rank checks in this machine's form; what the form leaves out, said as not run."""
    form = ctx.form()
    if not form.multi_gpu:
        res.not_run("ranks2:nccl_two_gpus", f"{form.label}: NCCL between ranks needs two GPUs")
    scalers = ("fp16_inf:fsdp_sharded_scaler", "fp16_inf:oss_sdp_sharded_scaler", "fp16_inf:smp_amp_scaler")
    expected = (
        ["ranks2:device_choice"]
        + [f"ranks2:{n}" for n in STRATEGIES + scalers]
        + ["ranks2:checkpoint:async_fsdp_adamw_changed_after_return"]
    )
    run_ranks(res, ctx, ranks_worker, (ctx.small, str(res.path), form.multi_gpu), expected)
