"""Sources whose ranks hold whole tensors: every parameter and buffer of a module under its state-dict name."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from shardkit.checkpoint.errors import CheckpointError
from shardkit.checkpoint.universal.source import Held, Span
from shardkit.checkpoint.universal.split import split_of, tp_splits


def whole_tensors(module: nn.Module, replica_rank: int, replica_count: int) -> tuple[list[Held], dict[str, str]]:
    """Every tensor of ``module.state_dict()`` as one whole span, and the tied names.

    Parameters get ``(replica_rank, replica_count)``: data-parallel replicas hold identical parameters, so they
    split the writing. Buffers are written by the lowest rank alone (replica ``(0, 1)`` everywhere): replicas
    may hold different ones (BatchNorm statistics after a local forward), and a checkpoint keeps rank 0's, as a
    save from rank 0 would. A tensor reachable under several names (tied weights) is held once, under its first
    name; the other names become aliases of it, so every strategy stores a tie once, whichever name it keeps.

    A tensor-parallel parameter (:mod:`.split`) is held as this rank's slab of the full tensor: the ranks of one
    tensor-parallel group write different boxes of it, and ``(replica_rank, replica_count)`` must then count the
    ranks holding the same slab (the data-parallel group), not the whole job.
    """
    params = {id(p) for p in module.parameters()}
    splits = tp_splits(module)
    held: list[Held] = []
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if not hasattr(value, "shape") or not hasattr(value, "numel"):
            raise CheckpointError(
                f"state-dict entry '{name}' of {type(module).__name__} is a {type(value).__name__} (module extra "
                "state); the universal checkpoint layout stores tensors only"
            )
        if isinstance(value, DTensor):
            raise CheckpointError(
                f"state-dict entry '{name}' of {type(module).__name__} is a torch DTensor (torch's parallelize_module "
                "or fully_shard made it); the universal checkpoint layout stores shardkit's tensor-parallel layers, "
                "whose parameters are plain local tensors. Build the model from shardkit.tensor_parallel layers, or "
                "save it with torch.distributed.checkpoint (dcp.save(get_state_dict(model, optimizer)))"
            )
        known = first_name.get(id(value))
        if known is not None:
            aliases[name] = known
            continue
        first_name[id(value)] = name
        shape, split = split_of(splits, name, value.shape)
        span = Span(name, shape, 0, value.numel(), split=split)
        replicas = (replica_rank, replica_count) if id(value) in params else (0, 1)
        held.append(Held(value, (span,), *replicas))
    return held, aliases
