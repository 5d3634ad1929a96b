"""Every private or version-dependent torch API shardkit relies on, named once, with the releases checked.

torch promises nothing about names that start with an underscore, and some public ones arrived late. Each entry of
:data:`PRIVATE_APIS` says what shardkit uses, where, and since when torch has it; :func:`missing` resolves them all
on the installed torch, so one test (``tests/compat/test_torch_compat.py``, run by ``tools/torch_matrix.sh`` on
each release) tells which of them a release lacks before any strategy trips over it. The private names are
imported (or reached) in one import point per package, ``_torch_private.py`` in ``utils``, ``distributed``,
``nn``, ``checkpoint``, ``modelparallel``, ``plan`` and ``bench``, and nowhere else:
``tests/compat/test_torch_private.py`` scans ``src/`` for any other reach and checks every name an import point
reaches is listed here.

Checked on (``tools/torch_matrix.sh``, CPU): torch 2.14.1, 2.13.0, 2.11.0 and 2.8.0. Behaviour that differs
between releases is named here too (:func:`dcp_save_needs_full_cover_on_one_rank`,
:func:`cpu_flash_attention_takes_gqa`, :func:`autocast_cache_off`). The floor, 2.8, is set by
``torch.compiler.disable(..., reason=)``; ``dist.all_gather_single`` / ``reduce_scatter_single`` (2.13) are
optional, with the older ``*_into_tensor`` / ``*_tensor`` names as the fallback.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from shardkit.utils._torch_private import cuda_sleep


@dataclass(frozen=True)
class TorchAPI:
    """One torch name shardkit depends on: ``module`` and the dotted ``attr`` inside it (empty: the module)."""

    module: str
    attr: str
    used_by: str
    #: What breaks without it, and whether shardkit falls back.
    note: str = ""
    #: A keyword argument the callable must take (a signature that changed between releases).
    keyword: str = ""
    optional: bool = False

    @property
    def name(self) -> str:
        """``module.attr`` (``module(keyword=)`` for a signature entry)."""
        base = f"{self.module}.{self.attr}" if self.attr else self.module
        return f"{base}({self.keyword}=)" if self.keyword else base

    def problem(self) -> str:
        """Why the installed torch lacks it, or "" when it has it."""
        try:
            value: object = importlib.import_module(self.module)
        except Exception as err:
            return f"cannot import {self.module}: {type(err).__name__}: {err}"
        for part in filter(None, self.attr.split(".")):
            if not hasattr(value, part):
                return f"{self.module} has no {self.attr}"
            value = getattr(value, part)
        if self.keyword:
            try:
                params = inspect.signature(value).parameters  # type: ignore[arg-type]
            except (TypeError, ValueError):
                return f"cannot read the signature of {self.name}"
            if self.keyword not in params:
                return f"{self.module}.{self.attr} takes no {self.keyword}="
        return ""


PRIVATE_APIS: tuple[TorchAPI, ...] = (
    TorchAPI("torch.utils._pytree", "tree_flatten", "modelparallel (trace, runtime, plan), memory.tracker"),
    TorchAPI("torch.utils._pytree", "tree_unflatten", "modelparallel runtime and pipeline"),
    TorchAPI("torch.utils._pytree", "tree_map", "nn.fsdp.input_cast, memory.tracker"),
    TorchAPI("torch.utils._pytree", "tree_leaves", "modelparallel.partitioning.trace"),
    TorchAPI("torch.utils._pytree", "TreeSpec", "modelparallel.partitioning.plan"),
    TorchAPI("torch.utils._python_dispatch", "TorchDispatchMode", "memory.tracker, plan.accountant, smp trace"),
    TorchAPI("torch.utils._python_dispatch", "_get_current_dispatch_mode_stack", "memory.tracker"),
    TorchAPI("torch.utils._python_dispatch", "is_in_torch_dispatch_mode", "memory.tracker"),
    TorchAPI("torch.utils.flop_counter", "flop_registry", "plan.accountant, modelparallel.partitioning.trace (FLOPs)"),
    TorchAPI("torch.distributed._tools.mem_tracker", "MemTracker", "plan.measure (cross-check of the planner)"),
    TorchAPI("torch._C._distributed_c10d", "_create_work_from_future", "plan.peerless (planned collectives)"),
    TorchAPI("torch._C", "_current_graph_task_id", "utils.autograd (inside-backward test)"),
    TorchAPI("torch._C", "_disabled_torch_function_impl", "utils.wrapper_tensor"),
    TorchAPI("torch", "Tensor._make_wrapper_subclass", "utils.wrapper_tensor (FSDP placeholders, planner)"),
    TorchAPI("torch.autograd", "Variable._execution_engine.queue_callback", "nn.fsdp runtime, sharded_ddp, slowmo"),
    TorchAPI("torch.nn.modules.module", "_IncompatibleKeys", "nn.fsdp.state_dict (load_state_dict's result)"),
    TorchAPI("torch.distributed.checkpoint.planner_helpers", "create_read_items_for_chunk_list", "checkpoint"),
    TorchAPI(
        "torch.distributed.checkpoint.default_planner",
        "create_default_global_save_plan",
        "checkpoint.universal.plans (a one-rank save's global plan before torch 2.9)",
    ),
    TorchAPI("torch.distributed.checkpoint.filesystem", "_StorageInfo", "checkpoint.safe_dcp (allowed in index)"),
    TorchAPI("torch.serialization", "_get_layout", "checkpoint.safe_dcp (allowed in index)"),
    TorchAPI("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING", "checkpoint.safe_dcp"),
    TorchAPI("torch.library", "custom_op", "memory.offload (shardkit::to_host)"),
    TorchAPI("torch.compiler", "disable", "nn.fsdp.runtime at import", "sets the floor: 2.8", keyword="reason"),
    TorchAPI("torch", "_foreach_norm", "optimizers, gradient clipping"),
    TorchAPI("torch.cuda", "_sleep", "bench.gpu_check (race amplifier only)"),
    TorchAPI("torch.distributed.pipelining", "Schedule1F1B", "bench.pipeline (comparison only)"),
    TorchAPI(
        "torch.distributed.pipelining.schedules",
        "PipelineScheduleSingle.step",
        "bench.pipeline",
        "2.9+; without it the keyword is left out (step_takes_return_outputs)",
        keyword="return_outputs",
        optional=True,
    ),
    TorchAPI(
        "torch.distributed.pipelining.schedules",
        "_batch_p2p",
        "bench.pipeline (bytes torch's schedules send)",
        "without it the bench prints '-'",
        optional=True,
    ),
    TorchAPI(
        "torch.distributed.pipelining.schedules",
        "_wait_batch_p2p",
        "bench.pipeline (torch's schedules' receive waits)",
        "without it the bench prints '-'",
        optional=True,
    ),
    TorchAPI("torch.distributed", "ProcessGroup._get_backend", "distributed.groups.group_timeout (falls back)"),
    TorchAPI("torch.distributed", "all_gather_single", "distributed.groups", "2.13+; falls back", optional=True),
    TorchAPI("torch.distributed", "reduce_scatter_single", "distributed.groups", "2.13+; falls back", optional=True),
    # Reached through the import points (``*/_torch_private.py``), listed here too so gpu-check resolves them.
    TorchAPI("torch.distributed.distributed_c10d", "_get_default_store", "distributed.health (falls back)"),
    TorchAPI("torch.distributed.distributed_c10d", "_resolve_process_group", "bench.tp (torch TP's bytes per group)"),
    TorchAPI("torch.distributed", "ProcessGroupGloo.Options._timeout", "distributed.groups.group_timeout"),
    TorchAPI("torch.nn.modules.batchnorm", "_BatchNorm", "nn.fsdp.helpers.auto_wrap_bn"),
    TorchAPI("torch", "Tensor._base", "nn.slowmo.flat (a view's learning rate)"),
    TorchAPI("torch.distributed.tensor", "DTensor._local_tensor", "memory.tracker (FSDP2 shards)"),
    TorchAPI("torch.amp", "GradScaler._unscale_grads_", "optim.grad_scaler (overridden: fp16 gradients)"),
    TorchAPI("torch.utils._python_dispatch", "_disable_current_modes", "plan.attention"),
    TorchAPI("torch", "_fused_sdp_choice", "plan.attention (the CPU's SDPA backend)"),
    TorchAPI("torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu", "plan.attention"),
    TorchAPI("torch", "ops.aten._scaled_dot_product_efficient_attention", "plan.attention"),
    TorchAPI("torch.distributed", "ProcessGroup._allgather_base", "plan.peerless (overridden)"),
    TorchAPI("torch.distributed", "ProcessGroup._reduce_scatter_base", "plan.peerless (overridden)"),
    TorchAPI("torch.distributed", "ProcessGroup._set_group_name", "plan.peerless (overridden)"),
    TorchAPI("torch.distributed", "ProcessGroup._set_group_desc", "plan.peerless (overridden)"),
    TorchAPI("torch._dynamo.eval_frame", "OptimizedModule", "modelparallel (routing a compiled unit)"),
    *(
        TorchAPI("torch", f"_foreach_{op}", "modelparallel.optimizers (LAMB, NovoGrad)")
        for op in ("add_", "addcmul_", "copy_", "div", "div_", "mul", "mul_", "sqrt_")
    ),
)


def missing(include_optional: bool = False) -> dict[str, str]:
    """``{name: problem}`` for every required entry the installed torch lacks (optional ones on request)."""
    return {
        api.name: problem
        for api in PRIVATE_APIS
        if (include_optional or not api.optional) and (problem := api.problem())
    }


def step_takes_return_outputs(schedule: object) -> bool:
    """Whether a ``torch.distributed.pipelining`` schedule's ``step`` takes ``return_outputs=`` (torch 2.9+; before,
    unknown keywords went on to the model's forward)."""
    step = getattr(schedule, "step", None)
    try:
        return step is not None and "return_outputs" in inspect.signature(step).parameters
    except (TypeError, ValueError):
        return False


def release() -> tuple[int, int]:
    """The installed torch's ``(major, minor)`` (``2.8.0+cpu`` -> ``(2, 8)``)."""
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if found is None:
        raise RuntimeError(f"cannot read torch's version from {torch.__version__!r}")
    return int(found.group(1)), int(found.group(2))


def dcp_save_needs_full_cover_on_one_rank() -> bool:
    """Whether DCP's default save planner refuses a save by one rank whose chunks do not cover each whole tensor.

    torch 2.8 checks the cover whatever the world size; from 2.9 (pytorch#147758) only a plan of several ranks is
    checked, since one rank may legitimately save its own part. Checked: 2.8.0 refuses; 2.11.0, 2.13.0 and 2.14.1
    do not (2.9 and 2.10 not run; the release follows the pull request's date)."""
    return release() < (2, 9)


def cpu_flash_attention_takes_gqa() -> bool:
    """Whether SDPA on CPU runs grouped-query attention (``enable_gqa=True`` with fewer key heads) with flash
    attention: from torch 2.9 (pytorch#157893); before, the CPU takes the math path for it, which the planner's
    :func:`shardkit.plan.attention.cpu_backend` learns from torch itself. Checked: 2.8.0 math; 2.11.0, 2.13.0 and
    2.14.1 flash (2.9 and 2.10 not run; the release follows the pull request's date)."""
    return release() >= (2, 9)


def v_schedules_run_on_gloo() -> bool:
    """Whether torch.distributed.pipelining's V-placement schedules (``ScheduleZBVZeroBubble``,
    ``ScheduleDualPipeV``) complete a step over gloo. Checked with ``shardkit bench pipeline --quick --layers 4``
    at 2 ranks: ZBVZeroBubble fails on 2.8.0 and 2.11.0, DualPipeV (from 2.9) on 2.11.0, in their batched
    sends ("Pair is not connected" on one rank, "Connection closed by peer" on the other); both run on 2.13.0 and
    train as smp (2.9, 2.10 and 2.12 not run, so they count as failing)."""
    return release() >= (2, 13)


@contextlib.contextmanager
def autocast_cache_off() -> Iterator[None]:
    """Inside, autocast neither reads nor fills its cache of low-precision parameter casts.

    For forwards a library runs inside the user's autocast region besides the user's own (smp's trace, under
    ``no_grad``). Until pytorch#165068 (issue #158232, merged December 2025) a cast made under ``no_grad`` was
    cached without its autograd history, and the next forward of the same autocast region reused it: that forward
    gave its parameters no gradient, silently. Later releases cache a cast with its history; turning the cache off
    costs those forwards a cast per use, on every release. Checked: 2.8.0 loses the gradient without it; 2.11.0,
    2.13.0 and 2.14.1 do not (2.9 and 2.10 not run)."""
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


def cuda_spin(cycles: int) -> None:
    """Keep the current CUDA stream busy for about ``cycles`` GPU clock cycles (nothing without CUDA).

    A test tool: work queued behind the spin starts late, so code that forgets to wait for it reads
    unfinished data."""
    if torch.cuda.is_available():
        cuda_sleep(cycles)


__all__ = [
    "PRIVATE_APIS",
    "TorchAPI",
    "autocast_cache_off",
    "cpu_flash_attention_takes_gqa",
    "cuda_spin",
    "dcp_save_needs_full_cover_on_one_rank",
    "missing",
    "release",
    "step_takes_return_outputs",
]
