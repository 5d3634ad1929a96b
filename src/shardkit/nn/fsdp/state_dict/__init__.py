"""State dicts of :class:`~shardkit.nn.fsdp.FullyShardedDataParallel`: full, local, DCP-sharded, optimizer.

Four views of the same parameters; every name is the *unwrapped* model's name (wrappers add no ``module.``):

===========================  ======================================================  ==============================
function                     what it holds                                            cost (per call)
===========================  ======================================================  ==============================
:func:`state_dict`           every parameter in full, FP32, plus buffers              one all-gather per flat param;
                                                                                      the full model on every rank
:func:`local_state_dict`     this rank's flat shards (``<unit>.flat_param_<i>``)      no communication
:func:`sharded_state_dict`   per parameter a row-sharded ``DTensor`` for              one all-gather per flat param
                             :mod:`torch.distributed.checkpoint` (any world size)     to save; one per parameter to
                                                                                      load; peak one flat param
optimizer functions          optimizer state unflattened per original parameter       one all-gather per state tensor
:func:`local_metadata_dict`  how the local shards map onto the full model; with       no communication
                             :func:`consolidate_shard_weights` (offline)
===========================  ======================================================  ==============================

Every function reads the model through the read model :func:`shardkit.nn.fsdp.layout` (names, flat ranges,
shards, buffers), never through a unit's run-time objects.

Shards cut across original parameters (see :mod:`~shardkit.nn.fsdp.flat_param`), so the DCP view gathers a
unit's flat parameter once and re-cuts every parameter into ``torch.chunk``-style row blocks, the layout DTensor's
``Shard(0)`` uses. A checkpoint saved at one world size then loads at any other, and into unwrapped models.

Loading validates everything first (keys, shapes, layouts) and agrees across ranks (a one-element all-reduce)
before the first write, so a bad state dict raises an error naming the key and leaves the model unchanged. Full
loads need no other communication: each rank cuts its own shard out of the full values.

Example::

    torch.save(model.state_dict(), "full.pt")             # keys as in the unwrapped model, on every rank
    model.load_state_dict(torch.load("full.pt"))

    dcp.save(sharded_state_dict(model), checkpoint_id=path)   # any world size ...
    target = sharded_state_dict(model)                         # ... loads at any other
    dcp.load(target, checkpoint_id=path)
    load_sharded_state_dict(model, target)
"""

from shardkit.nn.fsdp.state_dict.consolidate import consolidate_shard_weights, local_metadata_dict
from shardkit.nn.fsdp.state_dict.full import load_local_state_dict, load_state_dict, local_state_dict, state_dict
from shardkit.nn.fsdp.state_dict.optim import gather_full_optim_state_dict, get_shard_from_optim_state_dict
from shardkit.nn.fsdp.state_dict.sharded import load_sharded_state_dict, sharded_state_dict

__all__ = [
    "consolidate_shard_weights",
    "gather_full_optim_state_dict",
    "get_shard_from_optim_state_dict",
    "load_local_state_dict",
    "load_sharded_state_dict",
    "load_state_dict",
    "local_metadata_dict",
    "local_state_dict",
    "sharded_state_dict",
    "state_dict",
]
