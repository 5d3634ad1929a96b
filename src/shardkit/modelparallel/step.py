"""``@smp.step``: run a function once per micro-batch, pipelined, and gather what it returns.

The decorated function's tensor arguments (also inside lists, tuples, dicts and sets, and objects with an
``smp_slice(num_mb, mb, axis)`` method) are split along their batch axis into ``microbatches`` pieces. The
function then runs once per piece, in the pipeline schedule's order. What it returns keeps its structure: each
tensor becomes a :class:`StepOutput` holding its value for every micro-batch, each other value (``loss.item()``,
a count) a list of its per-micro-batch values, the output stage's on every rank (see :mod:`~.step_outputs`).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Iterable
from typing import Any, Callable, Optional, Union, overload

import torch

from shardkit.modelparallel import state as smp_state
from shardkit.modelparallel.pipeline.pipeline_parallel import StepRun
from shardkit.modelparallel.pipeline.step_inputs import StageInputs
from shardkit.modelparallel.pipeline.step_outputs import OutputSharing, StepOutput, gather_microbatch_outputs

__all__ = ["StepOutput", "gather_microbatch_outputs", "split_microbatch", "step"]

StepFunction = Callable[..., Any]


def split_microbatch(value: Any, num_mb: int, mb: int, axis: int, where: str) -> Any:
    """Micro-batch ``mb`` of ``num_mb`` of ``value`` (tensors narrowed along ``axis``, containers recursively)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return value
        size = value.shape[axis]
        if size % num_mb:
            raise ValueError(
                f"@smp.step argument {where}: size {size} along axis {axis} is not divisible by "
                f"microbatches={num_mb}; use a batch size that is a multiple of {num_mb}, or list the argument in "
                "non_split_inputs / set its axis in input_split_axes"
            )
        chunk = size // num_mb
        return value.narrow(axis, mb * chunk, chunk)
    if hasattr(value, "smp_slice") and not isinstance(value, type):
        return value.smp_slice(num_mb, mb, axis)
    if isinstance(value, (list, tuple)):
        items = [split_microbatch(v, num_mb, mb, axis, f"{where}[{i}]") for i, v in enumerate(value)]
        if hasattr(value, "_fields"):  # namedtuple
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, dict):
        return type(value)((k, split_microbatch(v, num_mb, mb, axis, f"{where}[{k!r}]")) for k, v in value.items())
    if isinstance(value, (set, frozenset)):
        return type(value)(split_microbatch(v, num_mb, mb, axis, where) for v in value)
    return value


@overload
def step(func: StepFunction) -> StepFunction: ...


@overload
def step(
    func: None = None,
    *,
    non_split_inputs: Optional[Iterable[str]] = None,
    input_split_axes: Optional[dict[str, int]] = None,
    detach_outputs: bool = True,
) -> Callable[[StepFunction], StepFunction]: ...


def step(
    func: Optional[StepFunction] = None,
    *,
    non_split_inputs: Optional[Iterable[str]] = None,
    input_split_axes: Optional[dict[str, int]] = None,
    detach_outputs: bool = True,
) -> Union[StepFunction, Callable[[StepFunction], StepFunction]]:
    """Decorate a function holding one forward and backward pass; it then runs pipelined, per micro-batch.

    ``non_split_inputs`` names arguments passed whole to every micro-batch; ``input_split_axes`` maps argument
    names to their batch axis (default 0); ``detach_outputs`` detaches returned tensors. Gradient clipping and
    ``optimizer.step()`` belong outside the decorated function.

    Example::

        @smp.step
        def train_step(model, x, y):
            loss = F.cross_entropy(model(x), y)
            model.backward(loss)
            return loss

        loss = train_step(model, x, y).reduce_mean()
        optimizer.step()
    """
    unsplit = set(non_split_inputs or ())
    axes = dict(input_split_axes or {})

    def decorate(fn: StepFunction) -> StepFunction:
        signature = inspect.signature(fn)
        # Per decorated function and model: its outputs' layout is checked on its first call. Keyed by the model
        # object itself (weakly): an ``id`` can be reused by a later model on one rank and not another, which
        # would have that rank skip a check the others make.
        sharings: weakref.WeakKeyDictionary[Any, OutputSharing] = weakref.WeakKeyDictionary()
        # Likewise its arguments: equal on every stage, or empty placeholders after the first (see step_inputs).
        inputs: weakref.WeakKeyDictionary[Any, StageInputs] = weakref.WeakKeyDictionary()

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            state = smp_state.current()
            model = state.model
            if model is None:
                raise RuntimeError(
                    f"@smp.step function {fn.__name__!r} was called before smp.DistributedModel(...) was created"
                )
            if model.running_step is not None:
                raise RuntimeError(f"@smp.step function {fn.__name__!r} was called inside another @smp.step call")
            bound = signature.bind(*args, **kwargs)
            aligned = inputs.setdefault(model, StageInputs()).align(bound.arguments, state, f"{fn.__name__!r}")
            bound = inspect.BoundArguments(signature, aligned)
            num_mb = state.config.microbatches
            per_mb = [_split_arguments(bound, num_mb, mb, unsplit, axes) for mb in range(num_mb)]

            def forward(mb: int) -> Any:
                return fn(*per_mb[mb].args, **per_mb[mb].kwargs)

            sharing = sharings.setdefault(model, OutputSharing())
            run = StepRun(lambda: model.stage_execution, num_mb, forward, detach_outputs, sharing)
            with model.running(run):
                outputs = run.run()
            model.last_step_stats = run.stats
            return gather_microbatch_outputs(outputs)

        return wrapper

    return decorate(func) if func is not None else decorate


def _split_arguments(
    bound: inspect.BoundArguments, num_mb: int, mb: int, unsplit: set[str], axes: dict[str, int]
) -> inspect.BoundArguments:
    pieces = {}
    for name, value in bound.arguments.items():
        if name in unsplit or num_mb == 1:
            pieces[name] = value
        else:
            pieces[name] = split_microbatch(value, num_mb, mb, axes.get(name, 0), repr(name))
    return inspect.BoundArguments(bound.signature, pieces)
