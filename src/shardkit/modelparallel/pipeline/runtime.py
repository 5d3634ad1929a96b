"""This rank's part of every model forward: owned unit calls compute and send, the others receive or fake.

The wrapped model's forward runs on every stage. Each unit module is routed through a dispatcher, because a
module hook cannot skip a call: on the unit's stage it runs the real forward and sends the outputs other stages
need; elsewhere it returns the real outputs when this stage needs them (received from the owner) and zero
placeholders otherwise. The routing is a subclass, as FSDP2's ``fully_shard`` does it: the unit's class becomes
a subclass of its own class (same name, ``isinstance`` holds, hooks and ``state_dict`` unchanged) whose
``forward`` dispatches to the original; nothing is assigned on the instance, so ``torch.compile``,
introspection and other libraries' instance-level wrappers see an ordinary method. :meth:`StageRuntime.uninstall`
gives each module its class back. What each stage
sent and received is recorded per micro-batch, for the backward pass.

Placeholder and receive shapes come from the plan, per input signature (and autocast state). A signature not
seen before is *discovered* (only possible in a step's first micro-batch, when all stages run it in lock step):
each owner shares its outputs' shapes with the replica right after computing them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from shardkit.modelparallel._torch_private import is_compiled_module
from shardkit.modelparallel.partitioning.plan import LeafSpec, PipelinePlan, UnitCall, signature_of
from shardkit.modelparallel.pipeline.pp_communications import StageLink
from shardkit.modelparallel.pipeline.saved_activations import SavedActivations
from shardkit.modelparallel.pipeline.split_backward import WeightGradients, backward_input
from shardkit.utils._torch_private import tree_flatten, tree_map, tree_unflatten

Shapes = tuple[tuple[Optional[LeafSpec], ...], ...]


@dataclass
class MicrobatchRecord:
    """What one micro-batch left on this stage for its backward pass."""

    index: int
    #: (output this stage computed, stage it went to), expecting that stage's gradient back.
    sent: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    #: (output received as a leaf, stage that computed it), owing it the leaf's gradient.
    received: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    #: ``model.backward(tensors, grads)`` requests made by the step function.
    backward: list[tuple[list[torch.Tensor], list[Optional[torch.Tensor]]]] = field(default_factory=list)
    backward_requested: bool = False
    outputs: Any = None
    #: A split backward's W half, left by :meth:`StageRuntime.backward_input` (None when nothing is left).
    weight_work: Optional[WeightGradients] = None

    def detach_outputs(self) -> None:
        """Detach the tensors the step function returned (after a split B, where the outputs are detached anyway).

        The returned loss is its graph's root: while it holds the graph, every node above the ones W runs again
        (a language model's logits, the last blocks' saved tensors) lives until the step's end, on every
        micro-batch at once; detached, autograd frees them as soon as W has run.
        """
        self.outputs = tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, self.outputs)


@dataclass
class _Invocation:
    record: MicrobatchRecord
    shapes: Optional[Shapes]
    discovered: list[tuple[Optional[LeafSpec], ...]]
    next_call: int = 0


def _needs_grad(dtype: torch.dtype) -> bool:
    return torch.is_grad_enabled() and (dtype.is_floating_point or dtype.is_complex)


def _dispatching_class(cls: type[nn.Module], runtime: StageRuntime, unit: str, compiled: bool) -> type[nn.Module]:
    """A subclass of ``cls`` (same name) whose ``forward`` goes through ``runtime`` as unit ``unit``.

    A ``compiled`` unit is routed at its call instead: the compiled code must not contain the routing (its
    sends and receives would break the graph or be traced into it), and ``torch.compile(module)``'s wrapper
    sets ``forward`` on the instance, where a class cannot reach it. The unit's own forward hooks then run on
    its stage only (inside the call), where an uncompiled unit's run on every stage.
    """
    name = "__call__" if compiled else "forward"
    original = getattr(cls, name)

    @functools.wraps(original)
    def routed(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return runtime.dispatch(unit, functools.partial(original, self), args, kwargs)

    return type(cls.__name__, (cls,), {name: routed, "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def _check_compiled(root: nn.Module, units: Sequence[str], below: Sequence[tuple[nn.Module, Any]]) -> None:
    """Refuse a compiled module smp cannot route: one spanning stages (its children's calls are routed), or one
    also activation-checkpointed (the checkpointing class would sit under the compiled call, never reached)."""
    checkpointed = {id(module) for module, _ in below}
    for name, module in root.named_modules():
        if not is_compiled_module(module):
            continue
        if not any(u == "" or name == u or name.startswith(u + ".") for u in units):
            raise ValueError(
                f"module {name or '(the model)'!r} is compiled (torch.compile) but its children sit on different "
                "pipeline stages, and smp routes each child's calls between stages, which compiled code cannot "
                "contain: compile modules that sit on one stage instead, before smp.DistributedModel, e.g. "
                "model.blocks[i] = torch.compile(model.blocks[i]) for each block"
            )
        if id(module) in checkpointed:
            raise ValueError(
                f"module {name!r} is both compiled and given to smp.set_activation_checkpointing: checkpoint the "
                "module before compiling it (torch.utils.checkpoint inside its forward), or leave one of the two out"
            )


def autocast_state() -> tuple[Any, ...]:
    """What autocast changes about the dtypes modules return: whether it is on, and its dtype, per device type.

    Part of the key of traced shapes: a script that trains under autocast and evaluates without it calls the
    model with the same input shapes but gets other output dtypes, which must be discovered, not assumed.
    """
    return tuple(
        (
            torch.is_autocast_enabled(device),
            torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None,
        )
        for device in ("cpu", "cuda")
    )


class StageRuntime:
    """Runs one stage of a partitioned model inside each ``@smp.step`` micro-batch."""

    def __init__(self, plan: PipelinePlan, stage: int, link: StageLink, device: torch.device) -> None:
        self.plan = plan
        self.stage = stage
        self.link = link
        self.device = device
        # Built inside the first forward, under the autocast state the plan was traced with.
        self._shapes: dict[tuple[Any, ...], Shapes] = {(plan.signature, autocast_state()): plan.shapes}
        self._active: Optional[_Invocation] = None
        self._installed: list[tuple[nn.Module, type[nn.Module]]] = []
        self._placeholders: dict[tuple[tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = {}

    def forget_traced_shapes(self) -> None:
        """Discover the units' output shapes and dtypes at the first step instead of taking the trace's: for a stage
        that computes in another dtype than the trace ran in (sharded data parallelism under fp16/bf16, where rank
        0 traced the FP32 module before it was sharded)."""
        self._shapes.clear()

    # ---- installation -------------------------------------------------------------------------------------

    def install(self, root: nn.Module, below: Sequence[tuple[nn.Module, type[nn.Module]]] = ()) -> None:
        """Route every unit module's calls through this runtime (see the module docstring).

        ``below`` lists (module, subclass of its class) changes made first, so they sit under the routing: a
        checkpointing subclass there recomputes the module's own forward without dispatching again. All are
        undone by :meth:`uninstall`.
        """
        modules = [(name, root.get_submodule(name)) for name in self.plan.units]
        _check_compiled(root, list(self.plan.units), below)  # checked first: nothing changes when one is refused
        for name, module in modules:
            if "forward" in vars(module) and not is_compiled_module(module):
                raise ValueError(
                    f"module {name!r} has a forward assigned on the instance (another library patched it); smp "
                    "routes a module's calls through its class, which an instance-level forward would bypass: "
                    "create the smp.DistributedModel before applying that patch, or remove it"
                )
        for module, cls in below:
            self._installed.append((module, type(module)))
            module.__class__ = cls
        for name, module in modules:
            original_cls = type(module)
            module.__class__ = _dispatching_class(original_cls, self, name, is_compiled_module(module))
            self._installed.append((module, original_cls))

    def uninstall(self) -> None:
        """Give every unit module (and every module changed ``below`` the routing) its own class back."""
        for module, original_cls in reversed(self._installed):  # last routed first: nested routes unwind
            module.__class__ = original_cls
        self._installed = []

    # ---- one model forward --------------------------------------------------------------------------------

    @contextmanager
    def invocation(self, record: MicrobatchRecord, args: Any, first_microbatch: bool) -> Iterator[None]:
        """Scope of one call of the wrapped model for micro-batch ``record``."""
        signature = (signature_of(args), autocast_state())
        shapes = self._shapes.get(signature)
        if shapes is None and not first_microbatch:
            raise RuntimeError(
                "the model was called with input shapes in a later micro-batch that the first micro-batch of this "
                f"step did not use ({signature}); smp needs every micro-batch to call the model the same way"
            )
        self._active = _Invocation(record, shapes, [])
        try:
            yield
            if self._active.next_call != len(self.plan.calls):
                missing = self.plan.calls[self._active.next_call].unit
                raise RuntimeError(
                    f"this forward skipped module {missing!r}, which the first step called: smp needs the same "
                    "module calls, in the same order, on every forward (no data-dependent control flow)"
                )
            if shapes is None:
                self._shapes[signature] = tuple(self._active.discovered)
        finally:
            self._active = None

    def dispatch(self, name: str, original: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """One call of unit ``name``: ``original`` (its real forward) runs only on the unit's own stage."""
        inv = self._active
        if inv is None:
            raise RuntimeError(
                f"module {name!r} was called outside the DistributedModel's forward; after partitioning, modules "
                "of the model may only run inside model(...) within an @smp.step function"
            )
        if inv.next_call >= len(self.plan.calls) or self.plan.calls[inv.next_call].unit != name:
            expected = self.plan.calls[inv.next_call].unit if inv.next_call < len(self.plan.calls) else "nothing"
            raise RuntimeError(
                f"module {name!r} was called where the first step called {expected!r} (call #{inv.next_call}): "
                "smp needs the same module calls, in the same order, on every forward"
            )
        call = self.plan.calls[inv.next_call]
        inv.next_call += 1
        if call.stage == self.stage:
            return self._run_local(call, inv, original, args, kwargs)
        return self._run_remote(call, inv)

    def _run_local(self, call: UnitCall, inv: _Invocation, original: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        leaves, spec = tree_flatten(out)
        if spec != call.treespec:
            raise RuntimeError(
                f"module {call.unit!r} returned a different structure than on the first step ({spec} vs "
                f"{call.treespec}); smp needs each module's outputs to keep their structure"
            )
        specs = tuple(LeafSpec(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else None for x in leaves)
        if inv.shapes is None:
            specs = self.link.share_from(specs, call.stage)
            inv.discovered.append(specs)
        elif specs != inv.shapes[call.index]:
            raise RuntimeError(
                f"module {call.unit!r} returned shapes {specs}, but shapes {inv.shapes[call.index]} for the same "
                "input shapes before; smp needs output shapes to depend only on input shapes"
            )
        for i, leaf in enumerate(leaves):
            if not call.consumers[i]:
                continue
            # A copy made now, inside autograd, is both what travels and what the returning gradient is
            # applied to: glue code may update ``leaf`` in place afterwards (``x += r``), which would
            # otherwise send the gradient through that later operation too.
            snapshot = leaf.clone(memory_format=torch.contiguous_format)
            for dst in call.consumers[i]:
                self.link.send(snapshot, dst, label=f"fwd:{call.unit}", private=True)
                if _needs_grad(leaf.dtype):
                    inv.record.sent.append((snapshot, dst))
        return out

    def _run_remote(self, call: UnitCall, inv: _Invocation) -> Any:
        if inv.shapes is None:
            specs = self.link.share_from(None, call.stage)
            inv.discovered.append(specs)
        else:
            specs = inv.shapes[call.index]
        wanted = [i for i, consumers in enumerate(call.consumers) if self.stage in consumers and specs[i] is not None]
        received = self.link.recv_many(
            [(specs[i].shape, specs[i].dtype, call.stage) for i in wanted],
            self.device,
            label=f"fwd:{call.unit}",
        )
        by_leaf = dict(zip(wanted, received))
        leaves: list[Any] = []
        for i, is_tensor in enumerate(call.is_tensor):
            spec = specs[i]
            if not is_tensor or spec is None:
                leaves.append(call.constants[i])
            elif i in by_leaf:
                leaf = by_leaf[i]
                if _needs_grad(leaf.dtype):
                    leaf.requires_grad_(True)
                    inv.record.received.append((leaf, call.stage))
                    # Glue or units may update what they get in place (ReLU(inplace=True)): hand out a
                    # non-leaf copy; its gradient still lands on the leaf.
                    leaf = leaf.clone()
                leaves.append(leaf)
            else:
                leaves.append(self._placeholder(spec))
        return tree_unflatten(leaves, call.treespec)

    def _placeholder(self, spec: LeafSpec) -> torch.Tensor:
        """A zero tensor standing in for an output this stage never needs.

        One per shape, reused by every call: nothing real is ever computed from a placeholder (the plan makes a
        stage receive whatever its real work depends on), so even glue code updating it in place is harmless,
        and the stage saves allocating and clearing it per micro-batch (megabytes for a vocabulary's logits).
        """
        key = (spec.shape, spec.dtype, self.device)
        tensor = self._placeholders.get(key)
        if tensor is None:
            tensor = self._placeholders[key] = torch.zeros(spec.shape, dtype=spec.dtype, device=self.device)
        return tensor

    # ---- backward -----------------------------------------------------------------------------------------

    def backward(self, record: MicrobatchRecord, loss_scale: float) -> None:
        """Backward of one micro-batch on this stage: gradients in from later stages, out to earlier ones."""
        tensors, grad_tensors = self._roots(record, loss_scale)
        if tensors:
            torch.autograd.backward(tensors, grad_tensors)
        self._send_input_grads(record, [leaf.grad for leaf, _ in record.received])

    def backward_input(
        self, record: MicrobatchRecord, loss_scale: float, split: bool = True, saved: Optional[SavedActivations] = None
    ) -> Optional[str]:
        """B of a split backward: this stage's input gradients, sent upstream at once; the parameters'
        gradients wait in ``record.weight_work`` for :meth:`backward_weight`.

        Runs the whole backward instead, and returns why, where it cannot be split (``split=False`` forces
        that: a stage with activation-checkpointed modules would recompute them in W). ``saved``: the hooks
        the forwards ran under, whose tensors only B needs are released when B ends.
        """
        tensors, grad_tensors = self._roots(record, loss_scale)
        leaves = [leaf for leaf, _ in record.received]
        if not tensors:  # nothing flows back through this stage for this micro-batch
            self._send_input_grads(record, [None] * len(leaves))
            return None
        result = backward_input(tensors, grad_tensors, leaves, saved) if split else "a checkpointed module runs here"
        if isinstance(result, str):
            if tensors:
                torch.autograd.backward(tensors, grad_tensors)
            self._send_input_grads(record, [leaf.grad for leaf in leaves])
            return result
        grads, record.weight_work = result
        self._send_input_grads(record, grads)
        # Out now, not with this stage's next receive (after the W's the schedule may run first): the stage
        # below waits on them. Safe to post alone: gradients only travel down, so their receiver never waits
        # for anything this stage posts after them before it posts the matching receive.
        self.link.flush()
        return None

    def backward_weight(self, record: MicrobatchRecord) -> None:
        """W of a split backward: the parameters' gradients of ``record`` (nothing if B ran unsplit)."""
        work, record.weight_work = record.weight_work, None
        if work is not None:
            work.run()

    def _roots(self, record: MicrobatchRecord, loss_scale: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Receive the gradients of what this stage sent; with the loss requests, where backward starts."""
        grads = self.link.recv_many(
            [(tuple(t.shape), t.dtype, dst) for t, dst in record.sent], self.device, label="bwd:grad_in"
        )
        roots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for (tensor, _), grad in zip(record.sent, grads):
            if tensor.requires_grad:
                prev = roots.get(id(tensor))
                roots[id(tensor)] = (tensor, grad if prev is None else prev[1] + grad)
        tensors = [t for t, _ in roots.values()]
        grad_tensors = [g for _, g in roots.values()]
        if self.stage == self.plan.output_stage:
            for req_tensors, req_grads in record.backward:
                for t, g in zip(req_tensors, req_grads):
                    if t.requires_grad:
                        tensors.append(t)
                        base = torch.ones_like(t) if g is None else g
                        grad_tensors.append(base * loss_scale if loss_scale != 1.0 else base)
        return tensors, grad_tensors

    def _send_input_grads(self, record: MicrobatchRecord, grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Send each received leaf's gradient back to the stage that computed it; then forget the micro-batch."""
        for (leaf, src), grad in zip(record.received, grads):
            self.link.send(grad if grad is not None else torch.zeros_like(leaf), src, label="bwd:grad_out")
        record.sent.clear()
        record.received.clear()
        record.backward.clear()
