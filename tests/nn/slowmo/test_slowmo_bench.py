"""The pieces of the "slowmo" benchmark suite that can be checked without running it (it is a program)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from slowmo_reference import make_batch, make_model

from shardkit.bench.ddp_hook import labelled_allreduce_hook
from shardkit.bench.slowmo import Measured, _verdict, parse_args, settings_from_args
from shardkit.distributed import count_comm_bytes
from shardkit.testing import run_distributed


class _Bucket:
    """What the hook reads from DDP's GradBucket (building a real DDP costs seconds of imports per worker)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def buffer(self) -> torch.Tensor:
        return self._tensor


def _hook_on_gradients(rank: int, world_size: int) -> dict[str, object]:
    model = make_model()
    x, y = make_batch(rank, 0)
    F.mse_loss(model(x), y).backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    with count_comm_bytes() as meter:
        averaged = labelled_allreduce_hook(dist.group.WORLD, _Bucket(flat.clone())).wait()  # type: ignore[arg-type]
    reference = make_model()
    for r in range(world_size):
        F.mse_loss(reference(make_batch(r, 0)[0]), make_batch(r, 0)[1]).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()]) / world_size
    return dict(close=bool(torch.allclose(averaged, expected, atol=1e-6)), bytes=meter.total_wire_bytes)


def test_ddp_comm_hook_averages_gradients_through_shardkit_collectives() -> None:
    for result in run_distributed(_hook_on_gradients, 2, timeout_s=60):
        assert result["close"] and result["bytes"] == 66 * 4  # 2(n-1)/n of 66 float32 gradients at n=2


def test_options_select_settings_and_reject_unknown_strategies() -> None:
    settings = settings_from_args(parse_args(["--quick", "--strategies", "ddp,sgp", "--steps", "12"]))
    assert settings.strategies == ("ddp", "sgp") and settings.demo.steps == 12 and settings.lm.d_model == 32
    with pytest.raises(SystemExit, match="unknown slowmo bench strategies"):
        settings_from_args(parse_args(["--strategies", "ddp,zero3"]))


def test_verdict_reports_each_target() -> None:
    ddp = Measured("ddp", eval_loss=1.10, bytes_per_step=300.0, slow_step_s=0.3)
    good = Measured("slowmo_localsgd", eval_loss=1.11, bytes_per_step=100.0, slow_step_s=0.1)
    bad = Measured("slowmo_localsgd", eval_loss=1.20, bytes_per_step=150.0, slow_step_s=0.4)
    assert _verdict([ddp, good])[-1].count("NOT met") == 0
    assert _verdict([ddp, bad])[-1].count("NOT met") == 3
