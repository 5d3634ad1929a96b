"""gpu-check parts: FSDP on real CUDA streams (prefetch, pinned offload, bf16, compile) and the universal
checkpoint saved from and loaded into GPU memory."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from shardkit.bench.gpu_check.common import (
    CUDA,
    DEVICE,
    Results,
    batches,
    build_lm,
    host_params,
    init_world_of_one,
    loss_gap,
    max_diff,
    small_lm,
    sync,
    train,
)


def wrap_blocks(model: nn.Module, **kwargs: Any) -> nn.Module:
    """shardkit FSDP: one unit per block and the root."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.nn import FullyShardedDataParallel as FSDP

    blocks: Any = model.blocks
    for i, block in enumerate(blocks):
        blocks[i] = FSDP(block, **kwargs)
    return FSDP(model, **kwargs)


@contextlib.contextmanager
def serial_streams() -> Iterator[None]:
    """Everything on the compute stream: what a run on side streams must equal bit for bit."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.nn.fsdp import comm_context

    original = comm_context.SideStream.get
    comm_context.SideStream.get = lambda self, device: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        comm_context.SideStream.get = original  # type: ignore[method-assign]


@contextlib.contextmanager
def lagging_side_streams(cycles: int = 2_000_000) -> Iterator[None]:
    """Each side-stream block starts with a GPU spin, so a missing wait reads unfinished data and a buffer freed
    too early is reused while still being written: a race that would be rare becomes a wrong number."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.nn.fsdp import comm_context
    from shardkit.utils.torch_compat import cuda_spin

    original = comm_context.SideStream.issue

    @contextlib.contextmanager
    def issue(self: Any, device: torch.device) -> Iterator[Any]:
        with original(self, device) as stream:
            if stream is not None:
                cuda_spin(cycles)
            yield stream

    comm_context.SideStream.issue = issue  # type: ignore[method-assign]
    try:
        yield
    finally:
        comm_context.SideStream.issue = original  # type: ignore[method-assign]


def _fsdp_case(small: bool, kwargs: dict[str, Any], on_device: bool = True) -> Callable[[], dict[str, Any]]:
    cfg = small_lm(small)

    def run(mode: str) -> tuple[list[float], dict[str, torch.Tensor], nn.Module]:
        model = wrap_blocks(build_lm(cfg, DEVICE if on_device else None), **kwargs)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ctx: dict[str, contextlib.AbstractContextManager[Any]] = {
            "streams": contextlib.nullcontext(),
            "serial": serial_streams(),
            "lagging": lagging_side_streams(),
        }
        with ctx[mode]:
            losses = train(model, optimizer, batches(cfg, 3, 8, seed=5))
        sync()
        return losses, host_params(model), model

    def check() -> dict[str, Any]:
        ref = build_lm(cfg, DEVICE)
        autocast = kwargs.get("compute_dtype") if kwargs.get("mixed_precision") else None
        ref_losses = train(
            ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9), batches(cfg, 3, 8, 5), autocast
        )
        losses, params, model = run("streams")
        serial_losses, serial_params, _ = run("serial")
        lag_losses, lag_params, _ = run("lagging")
        tolerance = 5e-2 if autocast is not None else 1e-4  # bf16 compute against autocast: not bitwise
        out = {
            "loss_gap_vs_plain": loss_gap(losses, ref_losses),
            "param_gap_vs_plain": max_diff(params, host_params(ref)),
            "streams_equal_serial": losses == serial_losses and max_diff(params, serial_params) == 0.0,
            "lagging_equal_serial": lag_losses == serial_losses and max_diff(lag_params, serial_params) == 0.0,
        }
        if kwargs.get("cpu_offload"):
            shards = list(model.parameters())
            out["shards_on_host"] = all(p.device.type == "cpu" for p in shards)
            out["shards_pinned"] = CUDA and all(p.is_pinned() for p in shards)
        out["ok"] = (
            out["loss_gap_vs_plain"] < tolerance
            and out["streams_equal_serial"]
            and out["lagging_equal_serial"]
            and out.get("shards_on_host", True) is True
        )
        return out

    return check


@contextlib.contextmanager
def lagging_offload_copies(cycles: int = 2_000_000) -> Iterator[None]:
    """Each activation copy down starts behind a GPU spin on its side stream, so an upload that does not wait for
    it reads an unfinished host buffer, and a source not kept from reuse is overwritten before it is read."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.nn.checkpoint.offload import CudaCopies
    from shardkit.utils.torch_compat import cuda_spin

    original = CudaCopies.copy_down

    def copy_down(self: Any, stream: Any, after: Any, host: torch.Tensor, tensor: torch.Tensor) -> Any:
        stream.wait_stream(after)
        with torch.cuda.stream(stream):
            cuda_spin(cycles)
        return original(self, stream, after, host, tensor)

    CudaCopies.copy_down = copy_down  # type: ignore[method-assign]
    try:
        yield
    finally:
        CudaCopies.copy_down = original  # type: ignore[method-assign]


def _activation_offload_case(small: bool) -> dict[str, Any]:
    """``checkpoint_wrapper(offload_to_cpu=True)`` on every block (asynchronous copies to pinned memory on a side
    stream, lagging) against the same model without offload: the same losses and parameters."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.nn.checkpoint import checkpoint_wrapper

    cfg = small_lm(small)
    data = batches(cfg, 3, 8, seed=13)

    def run(offload: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        model = build_lm(cfg, DEVICE)
        if offload:
            blocks: Any = model.blocks
            for i, block in enumerate(blocks):
                blocks[i] = checkpoint_wrapper(block, offload_to_cpu=True)
        losses = train(model, torch.optim.SGD(model.parameters(), lr=0.05), data)
        sync()
        return losses, host_params(model)

    ref_losses, ref_params = run(False)
    with lagging_offload_copies():
        losses, params = run(True)
    out = {"loss_gap": loss_gap(losses, ref_losses), "param_gap": max_diff(params, ref_params)}
    out["ok"] = out["loss_gap"] < 1e-5 and out["param_gap"] < 1e-5
    return out


def _compile_case(small: bool) -> dict[str, Any]:
    cfg = small_lm(small)
    data = batches(cfg, 3, 8, seed=11)
    eager = wrap_blocks(build_lm(cfg, DEVICE), mixed_precision=True, compute_dtype=torch.bfloat16)
    eager_losses = train(eager, torch.optim.SGD(eager.parameters(), lr=0.05), data)
    torch.compiler.reset()
    model = wrap_blocks(build_lm(cfg, DEVICE), mixed_precision=True, compute_dtype=torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    compiled: Any = torch.compile(model)  # inductor, Triton kernels on CUDA
    losses = train(compiled, optimizer, data)
    gap = loss_gap(losses, eager_losses)
    return {"ok": gap < 5e-2, "loss_gap_vs_eager": gap, "losses": losses}


def part_fsdp(res: Results, small: bool) -> None:
    """FSDP at world size 1 on the device: streams against stream-less, lagging streams, offload, bf16, compile."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.nn import BackwardPrefetch

    res.check("backend", lambda: {"backend": init_world_of_one()})
    prefetch = {"forward_prefetch": True, "backward_prefetch": BackwardPrefetch.BACKWARD_PRE}
    res.check("fsdp:fp32_prefetch", _fsdp_case(small, dict(prefetch)))
    res.check(
        "fsdp:bf16_prefetch", _fsdp_case(small, {"mixed_precision": True, "compute_dtype": torch.bfloat16, **prefetch})
    )
    res.check("fsdp:cpu_offload_pinned", _fsdp_case(small, {"cpu_offload": True, **prefetch}, on_device=False))
    res.check("checkpoint_wrapper:activation_offload", lambda: _activation_offload_case(small))


def part_compile(res: Results, small: bool) -> None:
    """``torch.compile`` (inductor) of shardkit FSDP in bf16 against the same model run eagerly."""
    # A private kernel cache: a cache shared with other processes on the machine can be half-written.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="gpu_check_inductor_"))
    res.check("backend", lambda: {"backend": init_world_of_one()})
    res.check("fsdp:compile_vs_eager", lambda: _compile_case(small))


def part_checkpoint(res: Results, small: bool) -> None:
    """The universal checkpoint from GPU memory, synchronous and asynchronous, with the rank's host peak: the
    weights are changed by queued GPU work just before the save, which must see the changed values."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.bench.rss import PeakRSS
    from shardkit.checkpoint import load_checkpoint, save_checkpoint, wait_for_checkpoint
    from shardkit.utils.torch_compat import cuda_spin

    res.check("backend", lambda: {"backend": init_world_of_one()})
    root = Path(tempfile.mkdtemp(prefix="gpu_check_ckpt_"))
    width = 256 if small else 4096

    def roundtrip(async_save: bool) -> dict[str, Any]:
        model = nn.Linear(width, width, bias=False).to(DEVICE)
        with torch.no_grad():
            model.weight.fill_(1.0)
            cuda_spin(500_000_000)  # queued GPU work ahead of the update the save must see
            model.weight.add_(2.0)
        with PeakRSS() as peak:
            save_checkpoint(root / f"async{int(async_save)}", step=1, model=model, async_save=async_save)
            wait_for_checkpoint()
        fresh = nn.Linear(width, width, bias=False).to(DEVICE)
        load_checkpoint(root / f"async{int(async_save)}", model=fresh)
        equal = bool(torch.equal(fresh.weight, model.weight))
        nbytes = model.weight.numel() * model.weight.element_size()
        return {"ok": equal, "roundtrip_equal": equal, "host_peak_bytes": peak.rise, "state_bytes": nbytes}

    res.check("checkpoint:sync", lambda: roundtrip(False))
    res.check("checkpoint:async", lambda: roundtrip(True))
