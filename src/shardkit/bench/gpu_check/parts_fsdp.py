"""gpu-check parts ``fsdp`` (FSDP on real CUDA streams: prefetch, lagging side streams, CPU offload with the batch
in host memory, bf16, activation offload) and ``compile`` (inductor against eager)."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import nn

from shardkit.bench.gpu_check.common import (
    CUDA,
    PartContext,
    batches,
    build_lm,
    deterministic,
    device,
    host_params,
    loss_gap,
    max_diff,
    small_lm,
    sync,
    train,
    world_of_one,
)
from shardkit.bench.gpu_check.results import Outcome, Results, all_true, at_most


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


def _fsdp_case(small: bool, kwargs: dict[str, Any], host_batches: bool = False) -> Callable[[], Outcome]:
    """FSDP with ``kwargs`` against the plain model, and its side streams against none (bitwise) and against
    lagging ones (bitwise). ``host_batches``: the model is built in host memory and the batches stay there (CPU
    offload: FSDP must bring them to the device it computes on)."""
    cfg = small_lm(small)
    data = batches(cfg, 3, 8, seed=5, on=torch.device("cpu") if host_batches else None)
    modes: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
        "streams": contextlib.nullcontext,
        "serial": serial_streams,
        "lagging": lagging_side_streams,
    }

    def run(mode: str) -> tuple[list[float], dict[str, torch.Tensor], nn.Module]:
        model = wrap_blocks(build_lm(cfg, None if host_batches else device()), **kwargs)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        with modes[mode]():
            losses = train(model, optimizer, data)
        sync()
        return losses, host_params(model), model

    def check() -> Outcome:
        autocast = kwargs.get("compute_dtype") if kwargs.get("mixed_precision") else None
        with deterministic() as nondeterministic:
            # drawn where the tested model is drawn (a GPU's generator gives other numbers than the host's)
            ref = build_lm(cfg).to(device()) if host_batches else build_lm(cfg, device())
            on_device = [(x.to(device()), y.to(device())) for x, y in data]
            ref_losses = train(ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9), on_device, autocast)
            losses, params, model = run("streams")
            serial_losses, serial_params, _ = run("serial")
            lag_losses, lag_params, _ = run("lagging")
        tolerance = 5e-2 if autocast is not None else 1e-4  # bf16 compute against autocast: not bitwise
        gap = loss_gap(losses, ref_losses)
        facts: dict[str, Any] = {
            f"loss_gap_vs_plain<={tolerance}": gap <= tolerance,
            "streams_equal_serial_bitwise": losses == serial_losses and max_diff(params, serial_params) == 0.0,
            "lagging_equal_serial_bitwise": lag_losses == serial_losses and max_diff(lag_params, serial_params) == 0.0,
        }
        if kwargs.get("cpu_offload"):
            shards = list(model.parameters())
            facts["shards_in_host_memory"] = all(p.device.type == "cpu" for p in shards)
            if CUDA:
                facts["shards_pinned"] = all(p.is_pinned() for p in shards)
        outcome = all_true(facts, "loss gap to the plain model within tolerance; streams change no bit")
        value = {**facts, "loss_gap": gap, "nondeterministic_ops": nondeterministic}
        return Outcome(outcome.ok, value, outcome.threshold, outcome.why)

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


def _activation_offload_case(small: bool) -> Outcome:
    """``checkpoint_wrapper(offload_to_cpu=True)`` on every block (asynchronous copies to pinned memory on a side
    stream, lagging) against the same model without offload: the same losses and parameters."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.nn.checkpoint import checkpoint_wrapper

    cfg = small_lm(small)
    data = batches(cfg, 3, 8, seed=13)

    def run(offload: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        model = build_lm(cfg, device())
        if offload:
            blocks: Any = model.blocks
            for i, block in enumerate(blocks):
                blocks[i] = checkpoint_wrapper(block, offload_to_cpu=True)
        losses = train(model, torch.optim.SGD(model.parameters(), lr=0.05), data)
        sync()
        return losses, host_params(model)

    with deterministic():
        ref_losses, ref_params = run(False)
        with lagging_offload_copies():
            losses, params = run(True)
    gap = max(loss_gap(losses, ref_losses), max_diff(params, ref_params))
    return at_most(gap, 1e-5, "largest loss/parameter gap of activation offload to none")


def part_fsdp(res: Results, ctx: PartContext) -> None:
    """FSDP at world size 1 on the device: streams against stream-less, lagging streams, offload, bf16."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.nn import BackwardPrefetch

    res.check("backend", world_of_one)
    prefetch = {"forward_prefetch": True, "backward_prefetch": BackwardPrefetch.BACKWARD_PRE}
    res.check("fsdp:fp32_prefetch", _fsdp_case(ctx.small, dict(prefetch)))
    bf16 = {"mixed_precision": True, "compute_dtype": torch.bfloat16, **prefetch}
    res.check("fsdp:bf16_prefetch", _fsdp_case(ctx.small, bf16))
    res.check("fsdp:cpu_offload_host_batches", _fsdp_case(ctx.small, {"cpu_offload": True, **prefetch}, True))
    res.check("checkpoint_wrapper:activation_offload", lambda: _activation_offload_case(ctx.small))


def part_compile(res: Results, ctx: PartContext) -> None:
    """``torch.compile`` (inductor) of shardkit FSDP in bf16 against the same model run eagerly, in stages: a
    failure says whether compiling, the first compiled step or the agreement with eager broke."""
    # A private kernel cache: a cache shared with other processes on the machine can be half-written.
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="gpu_check_inductor_")
        atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)
    res.check("backend", world_of_one)
    cfg = small_lm(ctx.small)
    data = batches(cfg, 3, 8, seed=11)
    found: dict[str, Any] = {}

    def eager() -> Outcome:
        model = wrap_blocks(build_lm(cfg, device()), mixed_precision=True, compute_dtype=torch.bfloat16)
        found["eager"] = train(model, torch.optim.SGD(model.parameters(), lr=0.05), data)
        return Outcome(True, found["eager"], "eager losses (the reference)")

    # On a GPU: inductor (Triton kernels). On CPU --small: aot_eager, which traces through FSDP's hooks as
    # inductor does but skips the C++ kernel build (over 50 s on a busy CPU).
    backend = "aot_eager" if ctx.small and not CUDA else "inductor"

    def first_step() -> Outcome:
        torch.compiler.reset()
        model = wrap_blocks(build_lm(cfg, device()), mixed_precision=True, compute_dtype=torch.bfloat16)
        found["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.05)
        found["compiled"] = torch.compile(model, backend=backend)
        found["losses"] = train(found["compiled"], found["optimizer"], data[:1])
        return Outcome(True, {"backend": backend, "losses": found["losses"]}, "the first compiled step runs")

    def agreement() -> Outcome:
        if "compiled" not in found or "eager" not in found:
            raise AssertionError("an earlier compile check failed")
        losses = found["losses"] + train(found["compiled"], found["optimizer"], data[1:])
        return at_most(loss_gap(losses, found["eager"]), 5e-2, "largest loss gap of compiled to eager (bf16)")

    res.check("compile:eager_reference", eager)
    res.check("compile:first_step", first_step)
    res.check("compile:three_steps_vs_eager", agreement)
