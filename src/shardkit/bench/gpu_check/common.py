"""What every gpu-check part shares: the result record, the device, a world of one, models and a train loop."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.models import LMConfig, TransformerLM, lm_batch

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda", 0) if CUDA else torch.device("cpu")
Batch = tuple[torch.Tensor, torch.Tensor]


class Results:
    """The checks of one part: each ``{"ok": bool, "value" or "error", "secs"}``, written to ``part_<name>.json``
    after every check, so a part killed by its time limit still leaves what it finished."""

    def __init__(self, part: str, out: Path) -> None:
        self.part, self.path = part, out / f"part_{part}.json"
        self.checks: dict[str, dict[str, Any]] = {}
        self.started = time.perf_counter()
        self.flush()

    def check(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` and record its value, or its error (a failing check never stops the part)."""
        start = time.perf_counter()
        value: Any = None
        try:
            value = fn()
            entry: dict[str, Any] = {"ok": _judge(value), "value": value}
        except Exception as err:  # the check reports every failure; the part goes on
            entry = {
                "ok": False,
                "error": f"{type(err).__name__}: {err}"[:2000],
                "trace": traceback.format_exc()[-3000:],
            }
        entry["secs"] = round(time.perf_counter() - start, 2)
        self.checks[name] = entry
        print(f"[{self.part}:{name}] {json.dumps(entry, default=str)[:600]}", flush=True)
        self.flush()
        return value

    def flush(self) -> None:
        """Write what is known so far."""
        doc = {"part": self.part, "device": str(DEVICE), "secs": round(time.perf_counter() - self.started, 1)}
        self.path.write_text(json.dumps({**doc, "checks": self.checks}, indent=1, default=str))


def _judge(value: Any) -> bool:
    """A check's value may carry its own verdict under ``"ok"`` (parity within tolerance); otherwise ok."""
    return bool(value.get("ok", True)) if isinstance(value, dict) else True


def sync() -> None:
    """Wait for the device (timings and peaks must include queued kernels)."""
    if CUDA:
        torch.cuda.synchronize()


def init_world_of_one() -> str:
    """A process group of this process alone: NCCL on CUDA (the backend users run), else gloo."""
    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="gpu_check_"), "store")
        os.environ.setdefault("LOCAL_RANK", "0")
        backend = "nccl" if CUDA else "gloo"
        extra: dict[str, Any] = {"device_id": DEVICE} if CUDA else {}
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1, **extra)
    return str(dist.get_backend())


def small_lm(small: bool) -> LMConfig:
    """A model with real work on a GPU, or a toy one for ``--small``."""
    if small:
        return LMConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, seq_len=16)
    return LMConfig(vocab_size=2048, d_model=256, n_heads=4, n_layers=4, seq_len=128)


def billion_lm(small: bool) -> LMConfig:
    """~1B parameters (d_model 2048, 18 blocks, vocabulary 32000, sequence 512), or a toy one for ``--small``."""
    if small:
        return LMConfig(vocab_size=128, d_model=64, n_heads=4, n_layers=2, seq_len=32)
    return LMConfig(vocab_size=32000, d_model=2048, n_heads=16, n_layers=18, seq_len=512)


def build_lm(cfg: LMConfig, device: Optional[torch.device] = None, seed: int = 0) -> TransformerLM:
    """The LM, seeded, on ``device`` (default: host memory)."""
    torch.manual_seed(seed)
    model = TransformerLM(cfg)
    return model.to(device) if device is not None else model


def batches(cfg: LMConfig, count: int, batch_size: int, seed: int) -> list[Batch]:
    """``count`` batches on the check's device."""
    out = []
    for i in range(count):
        x, y = lm_batch(cfg, batch_size, seed + i)
        out.append((x.to(DEVICE), y.to(DEVICE)))
    return out


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: list[Batch],
    autocast: Optional[torch.dtype] = None,
    after_backward: Callable[[], None] = lambda: None,
) -> list[float]:
    """Plain steps; the per-step loss (``.item()`` synchronises each step)."""
    losses = []
    for x, y in data:
        optimizer.zero_grad(set_to_none=True)
        ctx = torch.autocast(DEVICE.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with ctx:
            loss = TransformerLM.loss_fn(model(x).float(), y)
        loss.backward()
        after_backward()
        optimizer.step()
        losses.append(float(loss.item()))
    return losses


_INFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.", "module.", "_fpw_module.")


def host_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Floating-point state by clean name, in host memory (DTensors gathered; wrapper prefixes removed)."""
    out = {}
    for key, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        if not torch.is_tensor(value) or not value.is_floating_point():
            continue
        for infix in _INFIXES:
            key = key.replace(infix, "")
        out[key] = value.detach().float().cpu().clone()
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over the names both hold; an error when the names differ."""
    if set(a) != set(b):
        raise AssertionError(f"state names differ: {sorted(set(a) ^ set(b))[:6]}")
    return max((float((a[k] - b[k].to(a[k].dtype)).abs().max()) for k in a), default=0.0)


def loss_gap(a: list[float], b: list[float]) -> float:
    """Largest per-step difference of two loss curves of the same length."""
    if len(a) != len(b):
        raise AssertionError(f"{len(a)} losses against {len(b)}")
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def close_world() -> None:
    """Destroy the process group if there is one."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
