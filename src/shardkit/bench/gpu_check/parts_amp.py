"""gpu-check part ``amp``: fp16 autocast with a loss scaler, and an inf injected into one gradient.

For FSDP with ``ShardedGradScaler``, OSS + ShardedDataParallel with ``ShardedGradScaler`` and smp with
``smp.amp.GradScaler``: a clean step, then a step whose gradient holds an inf (on one rank only when there are
two), then a clean step. The poisoned step must be skipped on every rank (parameters and AdamW state unchanged
bit for bit) and the scale halved; the next step must move the parameters again. The same cases run at two ranks
in the ``ranks2`` part (:func:`scaler_cases`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from shardkit.bench.gpu_check.common import PartContext, batches, build_lm, device, small_lm, world_of_one
from shardkit.bench.gpu_check.results import Outcome, Results, all_true
from shardkit.models import LMConfig, TransformerLM

StepFn = Callable[[Any, torch.Tensor, torch.Tensor], None]


def _poison_one_gradient(model: nn.Module) -> bool:
    """Put an inf into the first gradient this rank holds; False when it holds none."""
    for p in model.parameters():
        if p.grad is not None and p.grad.numel():
            p.grad.view(-1)[0] = float("inf")
            return True
    return False


def _snapshot(model: nn.Module, optimizer: Any) -> list[torch.Tensor]:
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return [t.detach().clone() for t in list(model.parameters()) + state]


def _unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    return len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))


def scaler_run(
    cfg: LMConfig, model: nn.Module, optimizer: Any, scaler: Any, backward: StepFn, poison: bool
) -> dict[str, Any]:
    """Clean step, poisoned step (``poison``: this rank injects the inf), clean step; what each did."""
    data = batches(cfg, 3, 4, seed=40)
    count = len(list(model.parameters()))

    def step(i: int, inject: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], float, float]:
        optimizer.zero_grad()
        backward(model, *data[i])
        injected = _poison_one_gradient(model) if inject else False
        if inject and not injected:
            raise AssertionError("this rank holds no gradient to put the inf into")
        before, scale = _snapshot(model, optimizer), float(scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
        return before, _snapshot(model, optimizer), scale, float(scaler.get_scale())

    step(0, False)
    before, after, scale, new_scale = step(1, poison)
    clean_before, clean_after, _, _ = step(2, False)
    return {
        "poisoned_step_skipped": _unchanged(before, after),
        "scale_halved": new_scale == scale / 2,
        "next_step_moved": not _unchanged(clean_before[:count], clean_after[:count]),
        "scale_before": scale,
        "scale_after": new_scale,
    }


def _autocast_backward(scaler: Any) -> StepFn:
    def backward(model: Any, x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(x.device.type, dtype=torch.float16):
            loss = TransformerLM.loss_fn(model(x).float(), y)
        scaler.scale(loss).backward()

    return backward


def _strategy_case(name: str, small: bool, poison: bool) -> dict[str, Any]:
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.optim import ShardedGradScaler
    from shardkit.strategies.registry import OptimizerSpec, get_strategy

    cfg = small_lm(small)
    spec = OptimizerSpec(torch.optim.AdamW, {"lr": 1e-3})
    model, optimizer, _ = get_strategy(name).build(build_lm(cfg, device()), spec, dist.group.WORLD)
    scaler = ShardedGradScaler(init_scale=2.0**10)
    return scaler_run(cfg, model, optimizer, scaler, _autocast_backward(scaler), poison)


def _smp_case(small: bool, poison: bool, partitions: int = 1) -> dict[str, Any]:
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    import shardkit.modelparallel as smp

    smp.init({"partitions": partitions, "microbatches": 2})
    try:
        cfg = small_lm(small)
        model = smp.DistributedModel(build_lm(cfg))
        optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        scaler = smp.amp.GradScaler(init_scale=2.0**10)

        @smp.step
        def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.autocast(x.device.type, dtype=torch.float16):
                loss = TransformerLM.loss_fn(model(x).float(), y)
            model.backward(scaler.scale(loss))
            return loss

        return scaler_run(cfg, model, optimizer, scaler, lambda m, x, y: train_step(m, x, y), poison)
    finally:
        smp.reset()


def scaler_cases(small: bool, poison_rank: int, smp_partitions: int) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    """(check name, this rank's run) for every scaler; ``poison_rank`` alone injects the inf."""
    poison = dist.get_rank() == poison_rank
    return [
        ("fp16_inf:fsdp_sharded_scaler", lambda: _strategy_case("fsdp", small, poison)),
        ("fp16_inf:oss_sdp_sharded_scaler", lambda: _strategy_case("oss_sdp", small, poison)),
        ("fp16_inf:smp_amp_scaler", lambda: _smp_case(small, poison, smp_partitions)),
    ]


RULE = "the step with the inf changes no parameter or AdamW state on any rank, the scale halves, the next step moves"


def judge(per_rank: list[dict[str, Any]]) -> Outcome:
    """Every rank's facts true (the numbers are kept as the value)."""
    facts = {f"rank{r}:{k}": v for r, found in enumerate(per_rank) for k, v in found.items()}
    return all_true(facts, RULE)


def part_amp(res: Results, ctx: PartContext) -> None:
    """The scaler cases at world size 1 (NCCL on CUDA)."""
    res.check("backend", world_of_one)
    for name, run in scaler_cases(ctx.small, poison_rank=0, smp_partitions=1):
        res.check(name, lambda run=run: judge([run()]))  # type: ignore[misc]
