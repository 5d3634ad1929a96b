"""What every gpu-check part shares: its context (size, deadline), the device, a world of one, models built on the
device, a train loop, deterministic settings and state comparisons."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.bench.gpu_check.results import Outcome
from shardkit.bench.gpu_check.settings import RankForm, rank_form
from shardkit.models import LMConfig, TransformerLM, lm_batch

CUDA = torch.cuda.is_available()
Batch = tuple[torch.Tensor, torch.Tensor]
#: Seconds the rank harness keeps for its own report after a rank timeout (shardkit.distributed.spawn).
RANK_GRACE_S = 12.0


@dataclass(frozen=True)
class PartContext:
    """One part's settings: toy sizes or not, and the monotonic time by which its watchdogs must fire."""

    small: bool
    deadline: float

    def left(self) -> float:
        """Seconds before the part's own deadline (inside the runner's kill)."""
        return self.deadline - time.monotonic()

    def rank_timeout(self) -> float:
        """A timeout for a group of ranks that lets them report a hang (their stacks) before the deadline."""
        return max(5.0, self.left() - RANK_GRACE_S)

    def form(self) -> RankForm:
        """How two ranks run on this machine."""
        return rank_form(CUDA, torch.cuda.device_count() if CUDA else 0)


def device() -> torch.device:
    """This process's device, as shardkit chooses it (``cuda:LOCAL_RANK``, or ``cuda:0`` for a single process)."""
    # imported here: on a lent machine's torch, a module that fails to import fails the check that needs it only
    from shardkit.distributed.device import select_device

    return select_device()


def sync() -> None:
    """Wait for the device (timings and peaks must include queued kernels)."""
    if CUDA:
        torch.cuda.synchronize()


@contextlib.contextmanager
def deterministic() -> Iterator[list[str]]:
    """Deterministic kernels for exact comparisons (``CUBLAS_WORKSPACE_CONFIG`` is set by the part at start), and
    attention on its math kernel (the fused ones' backward on CUDA accumulate with atomics: two equal runs could
    differ in the last bit). Ops without a deterministic kernel warn instead of failing; the list yielded collects
    those warnings."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seen: list[str] = []
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings(record=True) as caught, sdpa_kernel([SDPBackend.MATH]):
            warnings.simplefilter("always")
            yield seen
        seen += sorted({str(w.message)[:200] for w in caught if "deterministic" in str(w.message)})
    finally:
        torch.use_deterministic_algorithms(previous)


def init_world_of_one() -> str:
    """A process group of this process alone: NCCL on CUDA (the backend users run), else gloo."""
    if not dist.is_initialized():
        folder = tempfile.mkdtemp(prefix="gpu_check_store_")
        atexit.register(shutil.rmtree, folder, True)
        store = os.path.join(folder, "store")
        backend = "nccl" if CUDA else "gloo"
        extra: dict[str, Any] = {"device_id": device()} if CUDA else {}
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1, **extra)
    return str(dist.get_backend())


def world_of_one() -> Outcome:
    """The check that starts the part's world of one: NCCL on CUDA, gloo on CPU, or a failure naming what came."""
    want = "nccl" if CUDA else "gloo"
    backend = init_world_of_one()
    return Outcome(backend == want, backend, want, "" if backend == want else f"the world of one runs {backend}")


def small_lm(small: bool) -> LMConfig:
    """A model with real work on a GPU, or a toy one for ``--small``."""
    if small:
        return LMConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, seq_len=16)
    return LMConfig(vocab_size=2048, d_model=256, n_heads=4, n_layers=4, seq_len=128)


def billion_lm(small: bool) -> LMConfig:
    """~1B parameters (width 2048, 18 blocks, vocabulary 32000, sequence 512), or a toy one for ``--small``."""
    if small:
        return LMConfig(vocab_size=128, d_model=64, n_heads=4, n_layers=2, seq_len=32)
    return LMConfig(vocab_size=32000, d_model=2048, n_heads=16, n_layers=18, seq_len=512)


def build_lm(cfg: LMConfig, on: Optional[torch.device] = None, seed: int = 0) -> TransformerLM:
    """The LM, seeded, created directly on ``on`` (its weights initialised there: nothing is copied from the
    host); default: host memory. The same seed draws different weights on a GPU than on the host: a reference
    for a model built on the host is built on the host too, then moved."""
    torch.manual_seed(seed)
    with torch.device(on or "cpu"):
        return TransformerLM(cfg)


def batches(cfg: LMConfig, count: int, batch_size: int, seed: int, on: Optional[torch.device] = None) -> list[Batch]:
    """``count`` batches on ``on`` (default: this process's device)."""
    target = on or device()
    return [tuple(t.to(target) for t in lm_batch(cfg, batch_size, seed + i)) for i in range(count)]  # type: ignore[misc]


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: list[Batch],
    autocast: Optional[torch.dtype] = None,
    after_step: Callable[[], Any] = lambda: None,
) -> list[float]:
    """Plain steps; the per-step loss (``.item()`` synchronises each step: parity checks only, never timed)."""
    losses = []
    for x, y in data:
        optimizer.zero_grad(set_to_none=True)
        ctx = torch.autocast(x.device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with ctx:
            logits = model(x).float()
            loss = TransformerLM.loss_fn(logits, y.to(logits.device))  # offload moves host inputs only
        loss.backward()
        optimizer.step()
        after_step()
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
