"""The strategy registry: availability never crashes, and the DDP comm formula matches what DDP sends."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from shardkit.distributed import comm_formulas as comm
from shardkit.strategies import registry as strategies
from shardkit.strategies.registry import OptimizerSpec, Strategy
from shardkit.testing import run_distributed
from shardkit.testing.models import LMConfig, TransformerLM, lm_batch


def _never(model, optim, group):  # type: ignore[no-untyped-def]
    raise AssertionError("an unavailable strategy must not be built")


def test_missing_module_is_reported_not_raised() -> None:
    missing = Strategy("x", "not written yet", _never, requires=("shardkit.no_such_module:Thing",))
    assert missing.unavailable_reason() == "shardkit.no_such_module does not exist yet"
    no_attr = Strategy("y", "", _never, requires=("shardkit.memory.meter:NoSuchClass",))
    assert "does not define NoSuchClass" in (no_attr.unavailable_reason() or "")
    assert Strategy("z", "", _never, requires=("torch.nn:Linear",)).unavailable_reason() is None


def test_registry_lists_baselines_and_rejects_unknown_names() -> None:
    names = [s.name for s in strategies.all_strategies()]
    assert names[:4] == ["ddp", "zero_torch", "oss_ddp", "oss_sdp"]
    assert {"fsdp", "fsdp_no_reshard"} <= set(names)
    available, missing = strategies.select()
    assert {s.name for s in available} | set(missing) == set(names)
    assert "ddp" in {s.name for s in available}
    with pytest.raises(ValueError, match="known strategies: ddp, zero_torch"):
        strategies.select(["ddp", "nope"])
    with pytest.raises(ValueError, match="already registered"):
        strategies.register(Strategy("ddp", "", _never))


def _ddp_bytes_seen_by_hook(rank: int, world_size: int) -> tuple[int, int]:
    torch.manual_seed(0)
    model = TransformerLM(LMConfig())
    formula = comm.ddp_allreduce_bytes(model, world_size)
    ddp, opt, _ = strategies.get_strategy("ddp").build(model, OptimizerSpec(), dist.group.WORLD)
    assert isinstance(ddp, DistributedDataParallel)
    seen = []

    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]
        seen.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_hook)
    tokens, targets = lm_batch(model.cfg, 2, seed=rank)
    TransformerLM.loss_fn(ddp(tokens), targets).backward()
    opt.step()
    n = world_size
    return formula, int(2 * (n - 1) / n * sum(seen))


def test_ddp_formula_equals_bucket_bytes_ddp_actually_reduces() -> None:
    for formula, hooked in run_distributed(_ddp_bytes_seen_by_hook, 2):
        assert formula == hooked > 0
