"""How a tensor-parallel parameter is split: the dimension, the stride, and the pieces of the full tensor each rank
holds. The layers record a :class:`ShardSpec` per split parameter; checkpoints, the DTensor view and shard files read
these (through :func:`tp_sharding`), never the layers' internals.

With ``stride`` 1, rank ``r`` of ``n`` holds the ``r``-th of ``n`` equal slices of dimension ``dim``. With a stride
``s`` (fairscale's ``stride`` argument, for fused weights such as ``[q; k; v]``), the dimension is cut into ``n * s``
equal pieces and rank ``r`` holds pieces ``r, r + n, r + 2n, ...``, so every rank gets a slice of each fused part.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardkit.tensor_parallel.layout import divisors
from shardkit.tensor_parallel.state import current_state


@dataclass(frozen=True)
class ShardSpec:
    """A parameter split along ``dim`` of the full tensor, in ``stride`` interleaved parts per rank."""

    dim: int
    stride: int = 1

    def local_size(self, full_size: int, tp_size: int) -> int:
        """The size of dimension :attr:`dim` on one rank."""
        return full_size // tp_size

    def shard(self, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        """This rank's part of ``full`` (a copy)."""
        piece = full.shape[self.dim] // (tp_size * self.stride)
        pieces = full.split(piece, dim=self.dim)
        return torch.cat(pieces[tp_rank::tp_size], dim=self.dim)

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's part, in rank order (the inverse of :meth:`shard`)."""
        per_rank = [s.chunk(self.stride, dim=self.dim) for s in shards]
        return torch.cat([part[j] for j in range(self.stride) for part in per_rank], dim=self.dim)


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel ranks one layer is split across: the 1-D mesh, its group, this rank and the degree."""

    mesh: DeviceMesh
    group: dist.ProcessGroup
    rank: int
    size: int

    def __deepcopy__(self, memo: dict[int, Any]) -> TPGroup:
        """The same group: a copied layer (``copy.deepcopy(model)`` for an EMA or a reference) communicates over the
        ranks its original does; a process group cannot be copied."""
        return self

    @classmethod
    def of(cls, mesh: Optional[DeviceMesh], who: str) -> TPGroup:
        """The group of a 1-D ``mesh``, or of the current state's tensor dimension when None."""
        if mesh is None:
            mesh = current_state(who).tp_mesh
        if mesh.ndim != 1:
            raise ValueError(f"{who}: pass the 1-D tensor-parallel mesh (mesh['tensor']), got {mesh}")
        return cls(mesh, mesh.get_group(), mesh.get_local_rank(), mesh.size())


def split_size(who: str, argument: str, size: int, tp_size: int, stride: int = 1) -> int:
    """``size // tp_size``, or a ``ValueError`` naming the layer, the size and the degrees that would divide it."""
    if size % (tp_size * stride) == 0:
        return size // tp_size
    fitting = [d for d in divisors(size) if size % (d * stride) == 0]
    parts = f" x stride {stride}" if stride > 1 else ""
    raise ValueError(
        f"{who}: {argument}={size} does not split across {tp_size} tensor-parallel ranks{parts}; tensor-parallel "
        f"sizes that divide it: {fitting}. Choose one of those as the tensor-parallel degree (smp's "
        "'tensor_parallel_degree', fairscale's initialize_model_parallel), or change the size."
    )


def init_shard_(
    local: torch.Tensor,
    full_shape: Sequence[int],
    spec: ShardSpec,
    init_method: Callable[[torch.Tensor], Any],
    tp: TPGroup,
    keep_full: bool = False,
) -> Optional[torch.Tensor]:
    """Initialise ``local`` as this rank's part of a full tensor that ``init_method`` fills.

    Every rank builds the full tensor from the same random state, so the split model starts from exactly the
    weights the unsplit one would (what fairscale does). Returns the full tensor when ``keep_full``.
    """
    with torch.no_grad():
        if tp.size == 1:
            init_method(local)
            return local if keep_full else None
        full = torch.empty(tuple(full_shape), dtype=local.dtype, device=local.device)
        init_method(full)
        local.copy_(spec.shard(full, tp.rank, tp.size))
    return full if keep_full else None


class TensorParallelModule(nn.Module):
    """Base of the layers split across tensor-parallel ranks: they name their split parameters in :attr:`tp_specs`.

    Subclasses set ``self.tp = TPGroup.of(mesh, ...)`` and ``self.tp_specs = {"weight": ShardSpec(0)}`` (parameter
    name, relative to the module, to its split); parameters not named there are replicated on every rank.
    """

    tp: TPGroup
    tp_specs: dict[str, ShardSpec]
    #: Whether the first forward's input was compared across the tensor-parallel ranks (see ``checks``).
    input_checked: bool = False

    def __init__(self) -> None:
        super().__init__()
        _LIVE.add(self)

    def __setstate__(self, state: dict[str, Any]) -> None:  # copies (deepcopy, pickle) are live layers too
        super().__setstate__(state)
        _LIVE.add(self)


#: Every tensor-parallel layer alive in this process, so code that sees only parameters (an optimizer's clipping)
#: can ask which are split (:func:`shardkit.tensor_parallel.split_groups`). Weak: it keeps no layer alive.
_LIVE: weakref.WeakSet[TensorParallelModule] = weakref.WeakSet()


def live_tp_modules() -> list[TensorParallelModule]:
    """The tensor-parallel layers alive in this process (any model)."""
    return list(_LIVE)


#: Split parameters held by modules that are not :class:`TensorParallelModule` (the linears inside smp's transformer
#: blocks, whose block names its children's slices): owner module -> attribute -> (split, group). Weak: it keeps no
#: module alive.
_SPLIT_ELSEWHERE: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[ShardSpec, TPGroup]]] = (
    weakref.WeakKeyDictionary()
)


def register_split(owner: nn.Module, attr: str, spec: ShardSpec, tp: TPGroup) -> None:
    """Declare that parameter ``attr`` of ``owner`` holds this rank's slice, split by ``spec`` across ``tp``, for a
    module that is not a :class:`TensorParallelModule`. Clipping (:func:`~shardkit.tensor_parallel.split_groups`,
    FSDP's), checkpoints and :func:`tp_sharding` then treat it as the core's layers' split parameters; undeclared,
    each rank would count its own slice as the whole tensor (different clipping factors, one slice saved)."""
    if isinstance(owner, TensorParallelModule):
        raise TypeError(f"{type(owner).__name__} is a TensorParallelModule: name its split parameters in tp_specs")
    _SPLIT_ELSEWHERE.setdefault(owner, {})[attr] = (spec, tp)


def split_attrs(module: nn.Module) -> dict[str, tuple[ShardSpec, TPGroup]]:
    """The split parameters of ``module`` itself (not its children): attribute -> (split, group)."""
    if isinstance(module, TensorParallelModule):
        return {name: (spec, module.tp) for name, spec in module.tp_specs.items()}
    return dict(_SPLIT_ELSEWHERE.get(module, {}))


def modules_with_splits() -> list[nn.Module]:
    """Every live module holding split parameters: the core's layers and the owners :func:`register_split` named."""
    return [*live_tp_modules(), *_SPLIT_ELSEWHERE.keys()]


def tp_sharding(model: nn.Module) -> dict[str, ShardSpec]:
    """Every split parameter of ``model`` by its qualified name (``state_dict`` key) and how it is split."""
    return {name: spec for name, (spec, _) in tp_split_groups(model).items()}


def tp_split_groups(model: nn.Module) -> dict[str, tuple[ShardSpec, TPGroup]]:
    """As :func:`tp_sharding`, with the tensor-parallel group each parameter is split across (its rank and degree):
    what a checkpoint needs to place this rank's slice in the full tensor without gathering it."""
    groups: dict[str, tuple[ShardSpec, TPGroup]] = {}
    for prefix, module in model.named_modules():
        for name, (spec, tp) in split_attrs(module).items():
            if getattr(module, name, None) is not None:
                groups[f"{prefix}.{name}" if prefix else name] = (spec, tp)
    return groups
