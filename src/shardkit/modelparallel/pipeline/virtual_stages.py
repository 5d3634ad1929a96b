"""Virtual stages at run time: ``v`` chunks per rank, each run as its own pipeline stage, on a common tick clock.

The plan is made for ``p * v`` chunks (:mod:`~shardkit.modelparallel.schedules.virtual_schedules` places chunk ``c`` on
rank ``c % p``; ``"zbv"`` and ``"dualpipev"`` place them in a V instead, see ``placement``). Two views of it are used:

- the *chunk plan* drives the forward dispatch. A chunk's forward of micro-batch ``k`` is one call of the
  step function in which only that chunk's units compute (:class:`ChunkedRuntime` sets the active chunk): the
  others, this rank's other chunks included, return received values or placeholders, exactly as another
  stage's units do without virtual stages. So each chunk has its own autograd graph, its own record
  (what it sent and received) and its own backward, and the schedule can order chunks freely. The price:
  the step function runs ``v`` times per micro-batch on each rank, its code outside the model's units
  (glue, the loss) on placeholders where it is not real, as it already does on every stage without them.
- the *rank plan* (:func:`fold_plan`) is what everything else sees: which parameters this rank holds, which
  ranks share a tied parameter, where the outputs are real.

Under the V schedules each backward is split (:mod:`~shardkit.modelparallel.pipeline.split_backward`): B sends the input
gradients, W computes the parameters' gradients later and sends nothing. Where a rank's W comes right after its
B and no rank needs B's gradients sooner (:func:`~shardkit.modelparallel.schedules.virtual_schedules.fused_backwards`),
the two run as one unsplit backward at B's tick: the split costs time (about a tenth of the backward on the
bench LM on CPU) and buys nothing there; DualPipeV's paired steps are mostly such.

Messages. A message between chunks is named by (F or B, source chunk, destination chunk, micro-batch,
sequence number); messages between two chunks on one rank never leave it. Each step runs on the tick grid of
:func:`~shardkit.modelparallel.schedules.virtual_schedules.schedule_grid`: at tick ``t`` a rank runs its action,
then posts in one group (:meth:`ChunkLink.exchange`) the sends that action produced and the receives for
every message its neighbours' tick-``t`` actions produce, both sorted by name. Deadlock-free on a transport
whose sends block until received (NCCL) by construction: every rank posts exactly one group per tick, in tick
order; the group of tick ``t`` between two ranks holds the same messages in the same order on both sides; and
a rank's action at tick ``t`` only waits on messages of ticks before ``t``, whose groups every rank has posted
before it could reach tick ``t``. So the groups complete in tick order, whatever the transport.

Knowing the messages of a neighbour's forward takes the shapes of its outputs, before this rank has run any
forward of the step. So every step starts with a probe: every rank calls the step function for micro-batch
0, which stops (:class:`ProbeFinished`) as soon as it calls the model, having learned the model's input
signature; shapes never seen for that signature are discovered then, with one forward of every rank in lock
step, without autograd (:class:`_RankRuntime`). The probe costs the step function's code before its model call.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Callable, NamedTuple, Optional, Protocol

import torch

from shardkit.modelparallel.partitioning.plan import PipelinePlan, signature_of
from shardkit.modelparallel.pipeline.execution import StageExecution
from shardkit.modelparallel.pipeline.pp_communications import StageLink
from shardkit.modelparallel.pipeline.runtime import MicrobatchRecord, Shapes, StageRuntime, autocast_state
from shardkit.modelparallel.pipeline.virtual_p2p import ChunkLink, Expected, Key
from shardkit.modelparallel.schedules.virtual_schedules import (
    V_PIPELINES,
    ChunkAction,
    fused_backwards,
    placement,
    schedule_grid,
)
from shardkit.modelparallel.topology import Topology


class StepDriver(Protocol):
    """What a chunked step needs of ``pipeline_parallel.StepRun`` (named here so this module does not import it)."""

    microbatches: int
    #: Whether the step's returned tensors are detached (``@smp.step(detach_outputs=...)``).
    detach_outputs: bool

    def forward_into(self, record: MicrobatchRecord) -> None:
        """Run the step function on ``record``'s micro-batch, recording into ``record``."""


class ProbeFinished(BaseException):
    """Raised out of the step function's first model call of a step to end the probe (see the module doc).

    A ``BaseException``, so a step function's own ``except Exception`` does not take it for its error."""


def fold_plan(plan: PipelinePlan, chunk_ranks: tuple[int, ...]) -> PipelinePlan:
    """The chunk plan seen per rank: every chunk index replaced by its rank's (``chunk_ranks[chunk]``)."""
    num_ranks = max(chunk_ranks) + 1

    def rank(chunk: int) -> int:
        return chunk_ranks[chunk]

    calls = tuple(
        dataclasses.replace(
            call,
            stage=rank(call.stage),
            consumers=tuple(tuple(sorted({rank(d) for d in leaf} - {rank(call.stage)})) for leaf in call.consumers),
        )
        for call in plan.calls
    )
    return dataclasses.replace(
        plan,
        mp_size=num_ranks,
        units={unit: rank(chunk) for unit, chunk in plan.units.items()},
        calls=calls,
        output_stage=rank(plan.output_stage),
        holders={name: tuple(sorted({rank(c) for c in chunks})) for name, chunks in plan.holders.items()},
    )


def check_chunks(plan: PipelinePlan, partitions: int, virtual_stages: int, automatic: bool) -> None:
    """Refuse a plan that leaves a chunk without modules (its rank would pass activations through it idle)."""
    empty = sorted(set(range(plan.mp_size)) - set(plan.units.values()))
    if not empty:
        return
    if automatic:
        raise ValueError(
            f"{virtual_stages} chunks per rank with partitions={partitions} needs {plan.mp_size} chunks, but the "
            f"model has only {len(set(plan.units))} modules the partitioner can place (chunks {empty} would be "
            "empty): lower virtual_stages (or use a pipeline other than 'zbv' or 'dualpipev'), or a model with at "
            "least as many blocks as chunks"
        )
    raise ValueError(
        f"with {plan.mp_size} chunks for partitions={partitions}, smp.partition(i) places modules on chunk i; no "
        f"module was placed on chunks {empty}: use every index in 0..{plan.mp_size - 1}"
    )


class _RankRuntime(StageRuntime):
    """The rank plan's runtime: runs all of this rank's chunks in one forward, for shape discovery only."""

    def learned_shapes(self, key: tuple[Any, ...]) -> Optional[Shapes]:
        """The shapes discovered for ``key`` (None if never seen)."""
        return self._shapes.get(key)


class ChunkedRuntime(StageRuntime):
    """The forward dispatch of one rank's chunks: ``stage`` is the running chunk (see the module docstring)."""

    def __init__(self, plan: PipelinePlan, topology: Topology, link: ChunkLink, rank_runtime: _RankRuntime) -> None:
        super().__init__(plan, topology.mp_rank, link, rank_runtime.device)
        self.chunk_link = link
        self.rank = topology.mp_rank
        self.num_ranks = topology.mp_size
        self.chunk_ranks = link.chunk_ranks
        self.chunks = tuple(c for c, r in enumerate(self.chunk_ranks) if r == self.rank)
        """This rank's chunks, ascending."""
        self.rank_runtime = rank_runtime
        self.mode = "probe"
        """``"probe"`` at a step's start, ``"discover"`` while the probe learns new shapes, ``"run"`` in a step."""
        self.step_key: Optional[tuple[Any, ...]] = None
        """The model's input signature this step (learned by the probe)."""

    def activate(self, chunk: int) -> None:
        """Make ``chunk`` the one whose units compute in the next forward or backward."""
        self.stage = chunk

    @contextmanager
    def invocation(self, record: MicrobatchRecord, args: Any, first_microbatch: bool) -> Iterator[None]:
        """A chunk's forward in a step; at a step's start, the probe (see the module docstring)."""
        if self.mode == "run":
            with super().invocation(record, args, first_microbatch=False):
                yield
            return
        key = (signature_of(args), autocast_state())
        self.step_key = key
        if key not in self._shapes:
            self.mode = "discover"
            try:
                with torch.no_grad(), self.rank_runtime.invocation(MicrobatchRecord(0), args, first_microbatch=True):
                    yield
                self.rank_runtime.link.wait_sends()
            finally:
                self.mode = "probe"
            shapes = self.rank_runtime.learned_shapes(key)
            assert shapes is not None
            self._shapes[key] = shapes
        raise ProbeFinished

    def dispatch(self, name: str, original: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """One call of unit ``name`` (by the rank plan while discovering shapes)."""
        if self.mode == "discover":
            return self.rank_runtime.dispatch(name, original, args, kwargs)
        return super().dispatch(name, original, args, kwargs)

    def expected_messages(
        self, row: Sequence[Optional[ChunkAction]], records: dict[tuple[int, int], MicrobatchRecord]
    ) -> list[Expected]:
        """What the other ranks' actions of one tick send to this rank's chunks."""
        out: list[Expected] = []
        for rank, action in enumerate(row):
            if action is None or rank == self.rank:
                continue
            if action.kind == "F":
                out += self._forward_messages(action, rank)
            elif action.kind == "B":  # W sends nothing
                out += self._gradient_messages(action, records, rank)
        return out

    def _forward_messages(self, action: ChunkAction, rank: int) -> list[Expected]:
        assert self.step_key is not None
        shapes = self._shapes[self.step_key]
        seq: dict[int, int] = {}
        out = []
        for call in self.plan.calls:
            if call.stage != action.chunk:
                continue
            for i, consumers in enumerate(call.consumers):
                for dst in consumers:
                    n = seq.get(dst, 0)
                    seq[dst] = n + 1
                    spec = shapes[call.index][i]
                    if self.chunk_ranks[dst] == self.rank and spec is not None:
                        key: Key = ("F", action.chunk, dst, action.microbatch, n)
                        out.append(Expected(key, spec.shape, spec.dtype, rank))
        return out

    def _gradient_messages(
        self, action: ChunkAction, records: dict[tuple[int, int], MicrobatchRecord], rank: int
    ) -> list[Expected]:
        out = []
        for chunk in self.chunks:
            record = records[(chunk, action.microbatch)]
            if not record.backward_requested:
                continue
            sent = [t for t, dst in record.sent if dst == action.chunk]
            for n, tensor in enumerate(sent):
                key: Key = ("B", action.chunk, chunk, action.microbatch, n)
                out.append(Expected(key, tuple(tensor.shape), tensor.dtype, rank))
        return out


def chunked_runtime(
    plan: PipelinePlan, topology: Topology, pipeline: str, p2p_group: Any, mp_group: Any, device: Any
) -> ChunkedRuntime:
    """The runtime of this rank's chunks of the chunk plan ``plan`` (and its rank plan, for discovery)."""
    chunk_ranks = placement(pipeline, topology.mp_size, plan.mp_size // topology.mp_size)
    rank_plan = fold_plan(plan, chunk_ranks)
    rank_runtime = _RankRuntime(rank_plan, topology.mp_rank, StageLink(p2p_group, topology, mp_group), device)
    return ChunkedRuntime(plan, topology, ChunkLink(p2p_group, topology, mp_group, chunk_ranks), rank_runtime)


class ChunkedStep(NamedTuple):
    """What one chunked step leaves: results, and the times :class:`~.pipeline_parallel.StepStats` reports."""

    #: The step function's results per micro-batch (this rank's; the caller shares the output rank's).
    outputs: list[Any]
    #: Seconds computing each action kind, receive waits excluded.
    compute: dict[str, float]
    #: Every action: (``"F3@1"``, start, end, seconds of it blocked on receives).
    trace: list[tuple[str, float, float, float]]


class VirtualStageExecution(StageExecution):
    """A rank with several chunks: runs a whole step on the interleaved tick grid (:meth:`run_step`)."""

    runtime: ChunkedRuntime

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (its rank in the replica)."""
        return self.runtime.rank

    @property
    def output_stage(self) -> int:
        """The rank holding the last chunk, where the outputs are real."""
        return self.runtime.chunk_ranks[self.runtime.plan.output_stage]

    @property
    def virtual_stages(self) -> int:
        """Chunks per rank."""
        return len(self.runtime.chunks)

    @property
    def rank_plan(self) -> PipelinePlan:
        """The plan as this rank's holdings see it (see :func:`fold_plan`)."""
        return self.runtime.rank_runtime.plan

    def run_step(self, run: StepDriver) -> ChunkedStep:
        """Every chunk's forwards and backwards of ``run`` in tick order (follows the probe's forward)."""
        runtime, link = self.runtime, self.runtime.chunk_link
        if runtime.step_key is None:
            raise RuntimeError("the @smp.step function did not call the DistributedModel in this step")
        m = run.microbatches
        me = self.stage
        grid, kinds, whole, last_grads = _rank_steps(self.pipeline, self.num_stages, self.virtual_stages, m, me)
        records = {(c, k): MicrobatchRecord(k) for c in runtime.chunks for k in range(m)}
        split = self.pipeline in V_PIPELINES
        out_chunk = runtime.plan.output_stage if runtime.plan.output_stage in runtime.chunks else runtime.chunks[0]
        link.begin()
        runtime.mode = "run"
        compute = dict.fromkeys("FBW", 0.0)
        trace: list[tuple[str, float, float, float]] = []
        try:
            for t, row in enumerate(grid):
                action, kind = row[me], kinds[t]
                if action is not None and kind is not None:
                    began, waited = time.perf_counter(), link.wait_s
                    record = records[(action.chunk, action.microbatch)]
                    runtime.activate(action.chunk)
                    link.action = action
                    if t == last_grads:
                        self.before_last_backward()
                    if kind == "F":
                        # a split B frees what only it needed; the bench counts bytes
                        with self.saving(split and (action.chunk, action.microbatch) not in whole):
                            run.forward_into(record)
                        if action.chunk != out_chunk:
                            record.outputs = None  # placeholders' results: free what they hold
                    elif record.backward_requested:
                        self.run_backward(kind, record, m, run.detach_outputs)
                    link.action = None
                    ended, blocked = time.perf_counter(), link.wait_s - waited
                    counted = "B" if kind == "BW" else kind  # "B+W" apart: its own cost, not B's nor W's
                    compute[counted] = compute.get(counted, 0.0) + ended - began - blocked
                    trace.append((repr(action) + ("+W" if kind == "B+W" else ""), began, ended, blocked))
                link.exchange(runtime.expected_messages(row, records), self.device)
        finally:
            runtime.mode, runtime.step_key, link.action = "probe", None, None
        self.finish_step(any(r.backward_requested for r in records.values()))
        return ChunkedStep([records[(out_chunk, k)].outputs for k in range(m)], compute, trace)


class _RankSteps(NamedTuple):
    """One rank's part of a schedule's tick grid, as :meth:`VirtualStageExecution.run_step` runs it."""

    grid: tuple[tuple[Optional[ChunkAction], ...], ...]
    #: Per tick, what this rank runs (:func:`_kind`).
    kinds: tuple[Optional[str], ...]
    #: The (chunk, micro-batch) pairs whose B and W run as one backward, at B's tick (:func:`fused_backwards`).
    whole: frozenset[tuple[int, int]]
    #: The tick of the last action that makes parameter gradients (the gradient reduction is armed before it).
    last_grads: int


@functools.lru_cache(maxsize=64)
def _rank_steps(pipeline: str, num_ranks: int, virtual_stages: int, microbatches: int, rank: int) -> _RankSteps:
    """What ``rank`` runs at every tick: the same for every step of a shape, so made once (a few ms at 8 ranks)."""
    grid = schedule_grid(pipeline, num_ranks, virtual_stages, microbatches)
    split = pipeline in V_PIPELINES
    whole = frozenset(fused_backwards(grid, rank)) if split else frozenset()
    kinds = tuple(_kind(row[rank], split, whole) for row in grid)
    last_grads = max(t for t, kind in enumerate(kinds) if kind in ("W", "B+W", "BW"))
    return _RankSteps(tuple(tuple(row) for row in grid), kinds, whole, last_grads)


def _kind(action: Optional[ChunkAction], split: bool, whole: frozenset[tuple[int, int]]) -> Optional[str]:
    """What runs for ``action`` on this rank: ``"F"``, ``"B"``, ``"W"``; ``"B+W"`` for a B run with its W, and None
    for that W (and for an idle tick); ``"BW"`` for an unsplit backward."""
    if action is None or action.kind == "F":
        return None if action is None else "F"
    if not split:
        return "BW"
    if (action.chunk, action.microbatch) in whole:
        return "B+W" if action.kind == "B" else None
    return action.kind
