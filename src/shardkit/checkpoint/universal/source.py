"""What a strategy tells the universal checkpoint: which tensors this rank holds and which elements they contain.

A strategy implements :class:`UniversalSource` once; the engine derives the DCP write and read plans, the optimizer
state keyed by parameter name, and the checks before a load from it. Order of calls on save::

    source.before_save()          # e.g. SlowMo builds averaged copies; held() may return them from here on
    source.held(); source.local_optimizer()
    source.save_extra(directory, rank)
    source.after_save()           # drop the copies

and on load (``held()`` is asked without ``before_save``, so it returns the live tensors to write into)::

    source.held(); source.local_optimizer()
    apply = source.read_extra(directory, meta, rank)   # validation phase, no collectives
    ... the engine writes every held tensor and the optimizer state ...
    apply() if apply else None
    source.after_load()
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from shardkit.checkpoint.universal.split import Split, slab_numel

if TYPE_CHECKING:
    from shardkit.checkpoint.metadata import CheckpointMeta


@dataclass(frozen=True)
class Span:
    """Elements ``[start, stop)`` of the flattened full tensor ``fqn`` (full shape ``shape``), held at
    ``local.view(-1)[local_offset : local_offset + stop - start]`` of the tensor that carries this span.

    Example::

        >>> Span("lin.weight", torch.Size([4, 3]), 0, 12)   # the whole tensor
        >>> Span("lin.weight", torch.Size([4, 3]), 6, 12, local_offset=2)  # rows 2-3, two elements into a flat shard
        >>> Span("lin.weight", torch.Size([4, 6]), 0, 12, split=Split(1, 1, 2))  # columns 3-5 (tensor parallel)
    """

    fqn: str
    shape: torch.Size
    start: int
    stop: int
    local_offset: int = 0
    #: This rank's tensor-parallel slab of ``fqn`` (:mod:`.split`): ``start``/``stop`` then index the flattened slab,
    #: not the full tensor; ``shape`` stays the full shape.
    split: Optional[Split] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", torch.Size(self.shape))
        numel = slab_numel(self.shape, self.split)
        if not 0 <= self.start <= self.stop <= numel:
            raise ValueError(
                f"span of {self.fqn!r}: range [{self.start}, {self.stop}) is outside its {numel} elements "
                f"(shape {tuple(self.shape)})"
            )
        if self.local_offset < 0:
            raise ValueError(f"span of {self.fqn!r}: local_offset {self.local_offset} is negative")

    @property
    def numel(self) -> int:
        """Number of elements the span covers."""
        return self.stop - self.start


@dataclass(frozen=True)
class Held:
    """One tensor this rank holds (a parameter, an FSDP flat shard, a buffer) and which elements it contains.

    Ranks holding the same elements (data-parallel replicas) say so with ``replica_rank``/``replica_count``: they
    split the writing of those elements, each writing ``replica_share`` of every span. On load every replica reads
    the whole span.

    Example::

        >>> Held(model.lin.weight, (Span("lin.weight", model.lin.weight.shape, 0, 12),), replica_rank=rank,
        ...      replica_count=world_size)
    """

    tensor: torch.Tensor
    spans: tuple[Span, ...]
    replica_rank: int = 0
    replica_count: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "spans", tuple(self.spans))
        if self.replica_count < 1 or not 0 <= self.replica_rank < self.replica_count:
            raise ValueError(
                f"replica rank {self.replica_rank} of {self.replica_count} is invalid: need 0 <= rank < count"
            )
        numel = self.tensor.numel()
        for span in self.spans:
            if span.local_offset + span.numel > numel:
                raise ValueError(
                    f"span of {span.fqn!r} [{span.start}, {span.stop}) at local offset {span.local_offset} does not "
                    f"fit in the held tensor of {numel} elements"
                )


class UniversalSource(abc.ABC):
    """One strategy's view of a rank's state for the universal checkpoint layout.

    Subclasses set ``strategy`` (recorded in ``meta.json``) and implement :meth:`held` and
    :meth:`local_optimizer`; the other methods have no-op defaults.

    Example::

        class PlainSource(UniversalSource):
            strategy = "plain"

            def __init__(self, model, optimizer):
                self.model, self.optimizer = model, optimizer

            def held(self):
                return [Held(t, (Span(n, t.shape, 0, t.numel()),)) for n, t in self.model.state_dict().items()]

            def local_optimizer(self):
                return self.optimizer
    """

    strategy: str = ""

    @abc.abstractmethod
    def held(self) -> list[Held]:
        """Parameters and buffers this rank holds. Save reads them; load writes into them (in place)."""

    @abc.abstractmethod
    def local_optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The torch optimizer over exactly (a subset of) the held tensors, or None.

        Its state is read by parameter identity (``optimizer.state[param]``) and ``param_groups``; no other
        attribute is used, so a shadow optimizer over copies is fine on save."""

    def optimizer_replicas(self) -> Optional[tuple[int, int]]:
        """``(replica_rank, replica_count)`` for writing the optimizer state, where it is replicated differently
        from the held tensors (OSS: every rank holds the model, one rank per shard group holds a parameter's
        state). None (the default): the held tensor's replicas."""
        return None

    def group_fqns(self) -> Optional[list[list[str]]]:
        """Per param group of :meth:`local_optimizer`, the names of all its parameters on every rank, or None.

        Needed where a rank's share of a group can be empty (OSS partitions): the group's saved settings are then
        found by these names. None (the default): the names of the spans of the group's local parameters."""
        return None

    def group_settings(self) -> Optional[list[dict[str, Any]]]:
        """Per param group of :meth:`local_optimizer`, the settings to save (lr, betas, ...; "params" ignored),
        where a wrapper's own groups are the up-to-date ones (OSS). None (the default): the local optimizer's."""
        return None

    def load_optimizer(self, state_dict: dict[str, Any]) -> None:
        """Load the optimizer state the engine built for :meth:`local_optimizer` (a ``torch.optim`` state dict,
        parameters numbered in the local optimizer's order). Override where the local optimizer is owned by a
        wrapper that must load it itself."""
        optimizer = self.local_optimizer()
        if optimizer is not None:
            optimizer.load_state_dict(state_dict)

    def aliases(self) -> dict[str, str]:
        """Tied names: alias fqn -> the fqn stored in the checkpoint (default none)."""
        return {}

    def before_save(self) -> None:
        """Called on every rank before :meth:`held` is asked for a save (may build copies, e.g. averages)."""
        return None

    def after_save(self) -> None:
        """Called on every rank once the save's state is staged (drop whatever :meth:`before_save` built)."""
        return None

    def after_load(self) -> None:
        """Called on every rank after the tensors and optimizer state were written."""
        return None

    def save_extra(self, directory: Path, rank: int) -> None:
        """Write extra per-rank files into ``directory`` (they get digests like the rest). Default: nothing."""
        return None

    def read_extra(self, directory: Path, meta: CheckpointMeta, rank: int) -> Optional[Callable[[], None]]:
        """Read and check extra files during validation (no collectives; raise to refuse the load).

        Return a step to run after the universal state was written, or None."""
        return None
