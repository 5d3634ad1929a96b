"""smp's FP16/BF16 path (issue 34): ``"fp16": true`` / ``"bf16": true`` cast the model, ``DistributedOptimizer``
keeps FP32 master weights, and under fp16 scales the loss (static, or dynamic with smp's ``dynamic_loss_args``).

The reference is one plain-torch process doing the same by hand (written out below, not with shardkit's code): a
low-precision copy of the model, FP32 masters updated by a torch optimizer, the loss scaled in FP32, the gradients
copied into the masters and unscaled, a step with an inf/NaN skipped and the scale lowered. Where smp's arithmetic
is the reference's (one process, a pipeline: the same kernels on the same rows in the same order) results are
compared bitwise; under tensor parallelism the split matmuls sum in another order, see the tolerances there.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed

STEPS = 5
LR = 0.05
# A scale low enough that no gradient overflows by itself: the one inf is the injected one.
SCALE_ARGS = {"init_scale": 2.0**10, "scale_window": 2, "min_scale": 1, "delayed_shift": 1}
# The scale each step runs with, by smp's rules for SCALE_ARGS with an overflow at step 1 only: halved by the
# overflow, doubled at the second good step after it.
SCALES = [2.0**10, 2.0**10, 2.0**9, 2.0**9, 2.0**10]
INJECT_AT = 1
#: A bound the gradient norm never reaches: clip_master_grads computes the norm and leaves the gradients as they are.
NO_CLIP = 1e9


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step: int, poison: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch; ``poison``: its last row holds an inf at step INJECT_AT (the last replica's data)."""
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)
    if poison and step == INJECT_AT:
        x[-1, 0] = float("inf")
    return x, y


# ---- the reference: FP32 masters and loss scaling by hand, in one process ---------------------------------------


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread, as the harness's ranks run: CPU kernels split reductions by thread (LayerNorm's weight
    gradient in FP16 differs in its last bit between one and two threads), so bitwise parity needs the same count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _reference(
    dtype: torch.dtype,
    microbatches: int,
    clip: Optional[float],
    inject: bool,
    steps: int = STEPS,
    poison: bool = False,
) -> dict[str, Any]:
    """Train a ``dtype`` copy of :func:`_net` with FP32 masters under Adam, as smp's FP16 optimizer should."""
    with one_thread():
        return _reference_run(dtype, microbatches, clip, inject, steps, poison)


def _reference_run(
    dtype: torch.dtype, microbatches: int, clip: Optional[float], inject: bool, steps: int, poison: bool
) -> Any:
    model = _net().to(dtype)
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    optimizer = torch.optim.Adam(masters, lr=LR)
    losses, skipped, norms = [], [], []
    for step in range(steps):
        scale = SCALES[step] if dtype == torch.float16 else 1.0
        x, y = _batch(step, poison)
        for p in model.parameters():
            p.grad = None
        step_losses = []
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
            loss = F.mse_loss(model(xm.to(dtype)).float(), ym)
            # smp: model.backward(loss) scales the FP32 loss; the pipeline divides its gradient by the micro-batches
            torch.autograd.backward([loss.float() * scale], [torch.ones(()) / microbatches])
            step_losses.append(loss.item())
        losses.append(step_losses)
        if inject and step == INJECT_AT:
            next(model.parameters()).grad[0, 0] = float("inf")
        grads = [p.grad.float() * (1.0 / scale) for p in model.parameters()]
        overflow = dtype == torch.float16 and not all(torch.isfinite(g).all() for g in grads)
        skipped.append(overflow)
        if overflow:
            norms.append(-1.0)
            continue
        for master, grad in zip(masters, grads):
            master.grad = grad
        norms.append(torch.nn.utils.clip_grad_norm_(masters, clip).item() if clip else 0.0)
        optimizer.step()
        with torch.no_grad():
            for p, master in zip(model.parameters(), masters):
                p.copy_(master)
    return {
        "losses": losses,
        "skipped": skipped,
        "norms": norms,
        "masters": [m.detach() for m in masters],
        "weights": [p.detach() for p in model.parameters()],
    }


# ---- smp -------------------------------------------------------------------------------------------------------


def _build(dtype: torch.dtype) -> tuple[smp.DistributedModel, Any]:
    """The AWS scripts' set-up: model_creation(dtype=...), DistributedModel, the optimizer with its scale options."""
    with smp.tensor_parallelism(smp.tp_size() > 1):
        net = _net()  # built in FP32 and cast by DistributedModel: the same weights as the reference's cast
    model = smp.DistributedModel(net)
    assert all(p.dtype == dtype for p in net.parameters())
    optimizer = smp.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=LR),
        static_loss_scale=None,
        dynamic_loss_scale=True,
        dynamic_loss_args=SCALE_ARGS,
    )
    return model, optimizer


@smp.step
def _train_step(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


def _train(
    model: smp.DistributedModel,
    optimizer: Any,
    steps: range,
    inject: Callable[[], bool],
    clip: Optional[float],
    save: Optional[str] = None,
    prescaled: bool = False,
    poison: bool = False,
) -> dict[str, Any]:
    """The AWS scripts' loop: zero_grad, the step, clip_master_grads, step (each rank its share of the batch)."""
    shard = smp.rdp_size() if prescaled else smp.dp_size()
    index = smp.rdp_rank() if prescaled else smp.dp_rank()
    out: dict[str, Any] = {"losses": [], "skipped": [], "norms": [], "scales": []}
    for step in steps:
        x, y = (t.chunk(shard)[index] for t in _batch(step, poison))
        optimizer.zero_grad(set_to_none=True)
        out["scales"].append(optimizer.loss_scale)
        outputs = _train_step(model, x, y)
        out["losses"].append([t.item() for t in outputs.outputs])
        if step == INJECT_AT and inject():
            next(iter(model.local_parameters())).grad[0, 0] = float("inf")  # this rank alone overflows
        out["norms"].append(float(optimizer.clip_master_grads(clip)) if clip else 0.0)
        if clip and not optimizer.overflow and smp.tp_size() > 1:
            out.setdefault("clipped_norms", []).append(_master_grad_norm_over_tp(optimizer))
        optimizer.step()
        out["skipped"].append(optimizer.overflow)
        if save is not None and step == 2:
            smp.save_checkpoint(save, tag="step3", partial=True, model=model, optimizer=optimizer)
            smp.save_checkpoint(save, tag="full3", partial=False, model=model, optimizer=optimizer)
    out["masters"] = [p.detach().clone() for group in optimizer.fp32_from_fp16_groups for p in group]
    out["weights"] = [p.detach().clone() for p in model.module.parameters()]
    out["scaler"] = optimizer.state_dict().get("loss_scaler")
    return out


def _master_grad_norm_over_tp(optimizer: Any) -> float:
    """The 2-norm of the model's master gradients, by hand: a gradient every tensor-parallel rank holds equal (a
    replicated parameter) counted once, the different slices of a split one each."""
    total = 0.0
    for master in (p for group in optimizer.param_groups for p in group["params"]):
        grad = master.grad.double()
        gathered = [torch.empty_like(grad) for _ in range(smp.tp_size())]
        dist.all_gather(gathered, grad, group=smp.get_tp_process_group())
        replicated = all(torch.equal(g, gathered[0]) for g in gathered)
        total += grad.pow(2).sum().item() if replicated else sum(g.pow(2).sum().item() for g in gathered)
    return total**0.5


def _single(rank: int, world_size: int, dtype: torch.dtype) -> dict[str, Any]:
    smp.init(_config(dtype))
    try:
        model, optimizer = _build(dtype)
        return _train(model, optimizer, range(STEPS), lambda: dtype == torch.float16, clip=None)
    finally:
        smp.reset()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_one_process_trains_bitwise_like_fp32_masters_by_hand(dtype: torch.dtype) -> None:
    with one_thread():
        ours = _single(0, 1, dtype)
    fp16 = dtype == torch.float16
    theirs = _reference(dtype, microbatches=2, clip=None, inject=fp16)  # bf16 checks nothing: no inf there
    assert ours["skipped"] == theirs["skipped"] == [fp16 and s == INJECT_AT for s in range(STEPS)]
    assert ours["scales"] == (SCALES if fp16 else [1.0] * STEPS)
    assert ours["losses"] == theirs["losses"]
    assert all(torch.equal(a, b) for a, b in zip(ours["masters"], theirs["masters"]))
    assert all(torch.equal(a, b) for a, b in zip(ours["weights"], theirs["weights"]))
    assert all(m.dtype == torch.float32 for m in ours["masters"]) and ours["weights"][0].dtype == dtype


def _config(dtype: torch.dtype, **keys: Any) -> dict[str, Any]:
    return {"microbatches": 2, "fp16": dtype == torch.float16, "bf16": dtype == torch.bfloat16, **keys}


def _merged(per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Each parameter from the stage that holds it (the others hold an empty tensor)."""
    return [next(t for t in tensors if t.numel()) for tensors in zip(*per_rank)]


def _on_stage0() -> bool:
    return smp.pp_rank() == 0


def _never() -> bool:
    return False


def _pipeline(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Pipeline 2: fp16 with an inf on stage 0 alone, saved at step 3 (partial and full) and resumed from there;
    bf16."""
    out: dict[str, Any] = {}
    for dtype in (torch.float16, torch.bfloat16):
        fp16 = dtype == torch.float16
        smp.init(_config(dtype, partitions=2))
        try:
            model, optimizer = _build(dtype)
            inject = _on_stage0 if fp16 else _never  # bf16 checks nothing: an inf there is trained on
            run = _train(model, optimizer, range(STEPS), inject, NO_CLIP, folder if fp16 else None)
            out[str(dtype)] = {**run, "pp_rank": smp.pp_rank()}
        finally:
            smp.reset()
    for tag, partial in (("step3", True), ("full3", False)):
        smp.init(_config(torch.float16, partitions=2))
        try:
            model, optimizer = _build(torch.float16)
            smp.resume_from_checkpoint(folder, tag=tag, partial=partial)
            out[tag] = _train(model, optimizer, range(3, STEPS), _never, NO_CLIP)
        finally:
            smp.reset()
    return out


def test_pipeline2_fp16_skips_on_every_stage_clips_resumes_bitwise_and_bf16_trains(tmp_path: Any) -> None:
    results = run_distributed(_pipeline, 2, os.fspath(tmp_path))
    for dtype in (torch.float16, torch.bfloat16):
        fp16 = dtype == torch.float16
        theirs = _reference(dtype, microbatches=2, clip=NO_CLIP, inject=fp16)
        runs = [r[str(dtype)] for r in results]
        for run in runs:  # an inf on stage 0 alone: both stages skip step 1 and halve the scale
            assert run["skipped"] == theirs["skipped"] == [fp16 and s == INJECT_AT for s in range(STEPS)], run
            assert run["scales"] == (SCALES if fp16 else [1.0] * STEPS)
            # The same gradients every step (bitwise, below): the norm over both stages is torch's over the whole
            # model up to the order of the FP32 sums (~1e-7 each).
            assert run["norms"] == pytest.approx(theirs["norms"], rel=2e-6), (run["norms"], theirs["norms"])
        assert next(run for run in runs if run["pp_rank"] == 1)["losses"] == theirs["losses"]
        masters, weights = _merged([run["masters"] for run in runs]), _merged([run["weights"] for run in runs])
        assert all(torch.equal(a, b) for a, b in zip(masters, theirs["masters"]))
        assert all(torch.equal(a, b) for a, b in zip(weights, theirs["weights"]))
    for result, tag in ((r, tag) for r in results for tag in ("step3", "full3")):
        # resumed at step 3 from the partial and the full checkpoint: bitwise the uninterrupted run
        whole, resumed = result[str(torch.float16)], result[tag]
        assert resumed["losses"] == whole["losses"][3:] and resumed["scales"] == whole["scales"][3:]
        assert resumed["scaler"] == whole["scaler"]
        assert all(torch.equal(a, b) for a, b in zip(resumed["masters"], whole["masters"]))
        assert all(torch.equal(a, b) for a, b in zip(resumed["weights"], whole["weights"]))


def _on_tp_rank1() -> bool:
    return smp.tp_rank() == 1


def _tensor_parallel(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Tensor parallel 2 (both ranks on the whole batch): fp16 with an inf on TP rank 1 alone, clipped, resumed
    from step 3; bf16."""
    out: dict[str, Any] = {}
    for dtype in (torch.float16, torch.bfloat16):
        fp16 = dtype == torch.float16
        smp.init(_config(dtype, tensor_parallel_degree=2, ddp=True, prescaled_batch=True))
        try:
            model, optimizer = _build(dtype)
            assert isinstance(model.module[0], smp.nn.DistributedLinear)
            inject = _on_tp_rank1 if fp16 else _never
            out[str(dtype)] = _train(model, optimizer, range(STEPS), inject, 0.5, folder if fp16 else None, True)
        finally:
            smp.reset()
    smp.init(_config(torch.float16, tensor_parallel_degree=2, ddp=True, prescaled_batch=True))
    try:  # each TP rank's partial checkpoint holds its slices of the masters
        model, optimizer = _build(torch.float16)
        smp.resume_from_checkpoint(folder, tag="step3")
        out["resumed"] = _train(model, optimizer, range(3, STEPS), _never, 0.5, prescaled=True)
    finally:
        smp.reset()
    return out


def test_tensor_parallel2_fp16_skips_on_both_ranks_clips_exactly_resumes_and_bf16_trains(tmp_path: Any) -> None:
    results = run_distributed(_tensor_parallel, 2, os.fspath(tmp_path))
    for dtype in (torch.float16, torch.bfloat16):
        fp16 = dtype == torch.float16
        theirs = _reference(dtype, microbatches=2, clip=0.5, inject=fp16)
        for result in results:
            run = result[str(dtype)]
            assert run["skipped"] == theirs["skipped"] == [fp16 and s == INJECT_AT for s in range(STEPS)], run
            assert run["scales"] == (SCALES if fp16 else [1.0] * STEPS)
            # Every clip bound, and clip_master_grads' norm is the whole model's (split slices each, replicated
            # gradients once): the clipped gradients' norm by hand is 0.5 * n / (n + 1e-6), torch's coefficient, up
            # to FP32 rounding (~1e-7). A replicated gradient counted twice would be off by percents.
            norms = [n for n in run["norms"] if n != -1.0]
            assert min(norms) > 0.5
            expected = [0.5 * n / (n + 1e-6) for n in norms]
            assert run["clipped_norms"] == pytest.approx(expected, rel=4e-7), (run["clipped_norms"], expected)
            # The row-split layer adds two partial sums each rounded to the low dtype: one more rounding per
            # output than the reference's single matmul, so losses and norms differ by about one unit in the last
            # place of the dtype (measured: 1.5e-4 relative under fp16, 2.4e-3 under bf16), not more over 5 steps.
            ulp = 2.0**-11 if fp16 else 2.0**-8
            assert run["norms"] == pytest.approx(theirs["norms"], rel=ulp), (run["norms"], theirs["norms"])
            losses = [loss for step in run["losses"] for loss in step]
            assert losses == pytest.approx([loss for step in theirs["losses"] for loss in step], rel=ulp)
    for result in results:  # the partial checkpoint of each TP rank resumes bitwise
        whole, resumed = result[str(torch.float16)], result["resumed"]
        assert resumed["losses"] == whole["losses"][3:] and resumed["norms"] == whole["norms"][3:]
        assert all(torch.equal(a, b) for a, b in zip(resumed["masters"], whole["masters"]))
        assert all(torch.equal(a, b) for a, b in zip(resumed["weights"], whole["weights"]))


def _data_parallel(rank: int, world_size: int) -> dict[bool, Any]:
    """Two replicas, each on half the batch: fp16 with an inf in replica 1's data alone (its NaN gradients reach
    replica 0 through the all-reduce), without and with shard_optimizer_state (each replica updates half the
    masters, then shares them)."""
    out = {}
    for sharded in (False, True):
        smp.init(_config(torch.float16, ddp=True, shard_optimizer_state=sharded))
        try:
            model, optimizer = _build(torch.float16)
            out[sharded] = _train(model, optimizer, range(STEPS), _never, NO_CLIP, poison=True)
            out[sharded]["state"] = optimizer.local_state_dict()["state"]  # gathered from the shards
            out[sharded]["kept"] = len(optimizer.state)  # sharded: the state lives in the shards
        finally:
            smp.reset()
    return out


def test_data_parallel2_fp16_skips_on_both_replicas_with_and_without_sharded_state() -> None:
    results = run_distributed(_data_parallel, 2)
    # the replicas' 4 micro-batches in one process, the last one's data poisoned at step INJECT_AT
    theirs = _reference(torch.float16, microbatches=4, clip=NO_CLIP, inject=False, poison=True)
    for replica, result in enumerate(results):
        run, sharded = result[False], result[True]
        # the same Adam update of the same masters, each by the replica that owns it: bitwise the same run
        assert sharded["kept"] == 0 and run["kept"] == len(run["masters"])
        assert sharded["losses"][:INJECT_AT] == run["losses"][:INJECT_AT] and sharded["skipped"] == run["skipped"]
        assert sharded["losses"][INJECT_AT + 1 :] == run["losses"][INJECT_AT + 1 :]
        assert all(torch.equal(a, b) for a, b in zip(sharded["masters"], run["masters"]))
        assert all(torch.equal(a, b) for a, b in zip(sharded["weights"], run["weights"]))
        assert sorted(sharded["state"]) == sorted(run["state"]) == list(range(len(run["masters"])))
        for index, entry in run["state"].items():
            assert all(torch.equal(value, sharded["state"][index][key]) for key, value in entry.items())
        assert run["skipped"] == theirs["skipped"] == [s == INJECT_AT for s in range(STEPS)], run
        assert run["scales"] == SCALES
        # The replicas' FP16 gradients are averaged by an FP16 all-reduce, the reference's summed over the 4
        # micro-batches in one process: one more rounding, about one unit in FP16's last place (2**-11).
        assert run["norms"] == pytest.approx(theirs["norms"], rel=2.0**-11), (run["norms"], theirs["norms"])
        mine = [loss for step in run["losses"] for loss in step]
        expected = [loss for step in theirs["losses"] for loss in step[2 * replica : 2 * replica + 2]]
        assert mine == pytest.approx(expected, rel=2.0**-11, nan_ok=True), (mine, expected)


def _uneven(rank: int, world_size: int) -> tuple[int, bool]:
    """Replica 1 runs out of data a step early, inside model.join(): replica 0's last step must not wait for it."""
    smp.init(_config(torch.float16, ddp=True))
    try:
        model, optimizer = _build(torch.float16)
        steps = 3 if smp.dp_rank() == 0 else 2
        with model.join():
            for step in range(steps):
                x, y = (t.chunk(2)[smp.dp_rank()] for t in _batch(step))
                optimizer.zero_grad()
                _train_step(model, x, y)
                optimizer.step()  # the overflow check spans this replica's ranks, not the one that left
        return steps, optimizer.overflow
    finally:
        smp.reset()


def test_fp16_with_join_and_uneven_inputs_finishes() -> None:
    assert run_distributed(_uneven, 2, timeout_s=120) == [(3, False), (2, False)]
