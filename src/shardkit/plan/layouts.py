"""smp's 3-D layouts of one model at one world size: every (pipeline, tensor, data) factorisation smp accepts.

``shardkit plan --smp-layouts`` lists, for a model built of smp's tensor-parallel layers (``smp.nn``: the
``DistributedTransformer*`` blocks, ``DistributedLinear``, ``DistributedEmbedding``) and each world size ``W``, every
``pipeline x tensor x data = W`` that smp would train, and plans each one by running its real code (the ``smp``
strategy of :func:`shardkit.plan.estimate`, ``smp.init`` with ``partitions`` and ``tensor_parallel_degree``, once per
pipeline stage on the meta device; the stage with the highest peak is reported). smp's rules:

- the tensor-parallel degree divides every size the layers split (attention heads, feed-forward features, the
  embedding width, a ``DistributedLinear``'s input features), read from the model built at degree 1
  (:func:`split_facts`); a layer it does not know is still checked, by the real run, whose refusal is listed; a
  model without any of these layers takes no tensor degree above 1 (smp would hold it whole on every tensor rank);
- the pipeline degree is at most the number of layers (the longest ``nn.ModuleList``): smp cuts between them;
- the data degree is what is left, ``W / (pipeline x tensor)`` (smp's reduced data parallelism; smp's ``dp_size``
  is ``data x tensor``); with ``sharded=True`` each layout with data > 1 is also planned with
  ``sharded_data_parallel_degree = data`` (smp's ZeRO-3 over the reduced-data-parallel group); with
  ``prescaled=True`` each layout with tensor > 1 is also planned with ``prescaled_batch`` (what AWS's GPT scripts set:
  the ranks of a tensor-parallel group share one batch).

Every layout trains the same global batch as the data-parallel settings (``--batch-size`` sequences per rank):
without ``prescaled_batch`` each of smp's ``W / pipeline`` data-parallel ranks feeds its own batch, so one replica's
batch is ``pipeline x batch-size``; with it a tensor-parallel group feeds one, ``pipeline x tensor x batch-size``;
cut into ``2 x pipeline`` micro-batches where it divides (else ``pipeline``).

Example::

    shardkit plan --lm smp --smp-layouts --world-sizes 8 --batch-size 2
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.plan.api import Estimate, estimate
from shardkit.plan.cost import DeviceSpec, LinkSpec
from shardkit.plan.pipeline import model_blocks
from shardkit.plan.runner import LossFn, PlanError
from shardkit.plan.settings import Setting
from shardkit.plan.workloads import Workload
from shardkit.tensor_parallel import divisors

#: What each of smp's tensor-parallel layers splits, by class name: (what, the attribute holding its size).
SPLIT_SIZES: dict[str, tuple[tuple[str, str], ...]] = {
    "DistributedAttentionLayer": (("attention heads", "local_heads"),),
    "DistributedTransformerOutputLayer": (("feed-forward features", "dense1.out_features"),),
    "DistributedEmbedding": (("embedding width", "embedding_dim"),),
    "DistributedLinear": (("input features", "in_features"),),
}


@dataclass(frozen=True)
class SplitFacts:
    """What decides which layouts a model takes: its layer count (None: no ``nn.ModuleList``) and the sizes a
    tensor-parallel degree must divide, as ``(what, size)`` pairs (each once)."""

    layers: Optional[int]
    sizes: tuple[tuple[str, int], ...] = ()

    def tensor_problem(self, tensor: int) -> str:
        """Why the model cannot be split over ``tensor`` ranks, or ""."""
        if tensor > 1 and not self.sizes:  # smp would replicate it on every tensor rank: no layout worth listing
            return f"the model has no smp.nn tensor-parallel layers for tensor degree {tensor} to split"
        bad = [f"{what} {size}" for what, size in self.sizes if size % tensor]
        return f"tensor degree {tensor} does not divide the {', '.join(bad)}" if bad else ""

    def pipeline_problem(self, pipeline: int) -> str:
        """Why the model cannot be cut into ``pipeline`` stages, or ""."""
        if pipeline > 1 and self.layers is not None and pipeline > self.layers:
            return f"pipeline degree {pipeline} is more stages than the model's {self.layers} layers"
        if pipeline > 1 and self.layers is None:
            return "the model has no nn.ModuleList of layers for smp's pipeline to cut between"
        return ""


def _size(module: nn.Module, path: str) -> int:
    value: Any = module
    for part in path.split("."):
        value = getattr(value, part)
    return int(value)


def split_facts(model: nn.Module) -> SplitFacts:
    """The facts of ``model`` built at tensor-parallel degree 1 (its layers then hold their whole sizes)."""
    sizes: dict[tuple[str, int], None] = {}
    for module in model.modules():
        for what, path in SPLIT_SIZES.get(type(module).__name__, ()):
            sizes[(what, _size(module, path))] = None
    return SplitFacts(model_blocks(model), tuple(sizes))


def read_split_facts(build: Any) -> SplitFacts:
    """:func:`split_facts` of ``build()`` made on the meta device after a one-process ``smp.init`` (smp's layers read
    the layout when built). Needs a process without a torch.distributed group (the command line's)."""
    # start-up cost: smp imports shardkit.nn and torch._dynamo, which plans without the pipeline never need
    import shardkit.modelparallel as smp

    if dist.is_initialized():
        raise PlanError("plan smp's layouts from a process without a torch.distributed group (the command line)")
    smp.init({})
    try:
        with torch.device("meta"):
            return split_facts(build())
    finally:
        smp.reset()


@dataclass(frozen=True)
class Layout:
    """One factorisation of the world: ``pipeline x tensor x data`` ranks, the data ranks sharded or not, the
    tensor-parallel ranks sharing one batch (``prescaled``) or not."""

    pipeline: int
    tensor: int
    data: int
    sharded: bool = False
    prescaled: bool = False

    @property
    def world_size(self) -> int:
        return self.pipeline * self.tensor * self.data

    @property
    def label(self) -> str:
        extras = [name for name, on in (("sharded", self.sharded), ("prescaled", self.prescaled)) if on]
        return f"pp{self.pipeline} x tp{self.tensor} x dp{self.data}" + (f" ({', '.join(extras)})" if extras else "")

    @property
    def replica_ranks(self) -> int:
        """Ranks whose batches one model replica trains together: its stages, and its tensor ranks if prescaled."""
        return self.pipeline * (self.tensor if self.prescaled else 1)

    def options(self, batch_size: int) -> dict[str, Any]:
        """smp's config for this layout, one replica's batch being ``replica_ranks x batch_size`` sequences."""
        per_replica = batch_size * self.replica_ranks
        micro = 2 * self.pipeline if per_replica % (2 * self.pipeline) == 0 else self.pipeline
        config: dict[str, Any] = {"partitions": self.pipeline, "microbatches": micro, "pipeline": "interleaved"}
        if self.tensor > 1:
            config["tensor_parallel_degree"] = self.tensor
        if self.world_size > self.pipeline:
            config["ddp"] = True
        if self.sharded:
            config["sharded_data_parallel_degree"] = self.data
        if self.prescaled:
            config["prescaled_batch"] = True
        return config

    def setting(self, batch_size: int) -> Setting:
        """The planner's setting: strategy ``smp`` with :meth:`options`, over ``replica_ranks`` ranks' batches."""
        return Setting(self.label, "smp", self.options(batch_size), batch_ranks=self.replica_ranks)


def smp_layouts(
    world_size: int, facts: SplitFacts, sharded: bool = False, prescaled: bool = False
) -> tuple[list[Layout], list[str]]:
    """Every layout of ``world_size`` smp accepts for a model with ``facts`` (pipeline degree ascending, then tensor),
    and one ``"layout xW: why"`` line per factorisation it refuses."""
    valid: list[Layout] = []
    refused: list[str] = []
    for pipeline in divisors(world_size):
        for tensor in divisors(world_size // pipeline):
            layout = Layout(pipeline, tensor, world_size // (pipeline * tensor))
            why = facts.pipeline_problem(pipeline) or facts.tensor_problem(tensor)
            if why:
                refused.append(f"{layout.label} x{world_size}: {why}")
                continue
            valid.append(layout)
            if sharded and layout.data > 1:
                valid.append(replace(layout, sharded=True))
            if prescaled and layout.tensor > 1:
                valid.append(replace(layout, prescaled=True))
    return valid, refused


def config_refusal(options: dict[str, Any]) -> str:
    """smp's refusal of the config ``options`` (its first two lines: what and why), or "" when smp takes it."""
    # start-up cost: smp imports shardkit.nn and torch._dynamo, which plans without the pipeline never need
    import shardkit.modelparallel as smp

    try:
        smp.ModelParallelConfig.from_dict(options)
    except ValueError as exc:
        return "smp refuses the config: " + " ".join(line.strip() for line in str(exc).splitlines()[:2])
    return ""


def plan_layouts(
    work: Workload,
    world_sizes: Sequence[int],
    device: DeviceSpec,
    link: LinkSpec,
    backend: str = "nccl",
    loss: Optional[LossFn] = None,
    sharded: bool = False,
    prescaled: bool = False,
) -> tuple[list[tuple[Setting, Estimate]], list[str]]:
    """Plan every layout smp accepts at each world size (see the module docstring); the estimates, and one line per
    layout refused by smp's rules or by its real run."""
    facts = read_split_facts(work.build)
    results: list[tuple[Setting, Estimate]] = []
    failed: list[str] = []
    for world_size in world_sizes:
        layouts, refused = smp_layouts(world_size, facts, sharded, prescaled)
        failed += refused
        for layout in layouts:
            setting = layout.setting(work.batch_size)
            refusal = config_refusal(setting.options)
            if refusal:
                failed.append(f"{layout.label} x{world_size}: {refusal}")
                continue
            replica = replace(work, batch_size=work.batch_size * layout.replica_ranks)
            try:
                est = estimate(
                    replica.build, replica.batch(), loss_fn=loss or work.loss, strategy="smp", world_size=world_size,
                    optimizer=work.optimizer, optimizer_options=work.optimizer_options,
                    strategy_options=setting.options, device=device, link=link, backend=backend,
                )  # fmt: skip
            except (PlanError, ValueError, NotImplementedError) as exc:
                failed.append(f"{layout.label} x{world_size}: {exc}")
                continue
            results.append((setting, est))
    return results, failed


def check_layout_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``shardkit plan``: refuse flags that do not go with ``--smp-layouts`` (or need it), before planning."""
    for flag, given in (("--smp-sharded", args.smp_sharded), ("--smp-prescaled", args.smp_prescaled)):
        if given and not args.smp_layouts:
            parser.error(f"{flag} adds variants of smp's layouts: give --smp-layouts too")
    if args.smp_layouts:
        clashing = [flag for flag, given in (("--strategies", args.strategies), ("--tensor-parallel",
                    args.tensor_parallel > 1), ("--nprocs-per-node", args.nprocs_per_node)) if given]  # fmt: skip
        if clashing:
            parser.error(f"--smp-layouts plans smp's own layouts: drop {', '.join(clashing)}")


__all__ = [
    "SPLIT_SIZES",
    "Layout",
    "SplitFacts",
    "check_layout_flags",
    "plan_layouts",
    "read_split_facts",
    "smp_layouts",
    "split_facts",
]
