"""The tensor-parallel model as torch ``DTensor``s: what checkpoints and 2-D sharding consume.

The layers keep plain local parameters (fairscale's meaning: ``layer.weight`` is this rank's slice, and an
optimizer, ``load_state_dict`` or a per-rank file sees exactly that). :func:`tp_state_dict` describes the same
tensors to torch's distributed tooling without copying them: a split parameter becomes a ``DTensor`` with placement
``Shard(dim)`` over the layer's 1-D tensor-parallel mesh, every other tensor ``Replicate()``. ``full_tensor()`` on
one gives the unsplit weight; ``torch.distributed.checkpoint`` saves them without gathering.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardkit.tensor_parallel.sharding import TensorParallelModule, tp_sharding
from shardkit.tensor_parallel.state import current_state


def _model_mesh(model: nn.Module) -> DeviceMesh:
    for module in model.modules():
        if isinstance(module, TensorParallelModule):
            return module.tp.mesh
    return current_state("tp_state_dict").tp_mesh


def tp_state_dict(model: nn.Module, mesh: Optional[DeviceMesh] = None) -> dict[str, DTensor]:
    """``model.state_dict()`` with every tensor a ``DTensor`` over the tensor-parallel mesh (no copies).

    ``mesh`` defaults to the mesh of the model's tensor-parallel layers. Parameters split with a ``stride`` above 1
    (interleaved parts) have no single ``Shard`` placement and raise ``ValueError``.

    Example::

        sd = tp_state_dict(model)
        sd["output.weight"].placements      # (Shard(dim=0),)
        sd["output.weight"].full_tensor()   # the unsplit weight (an all-gather)
    """
    mesh = mesh if mesh is not None else _model_mesh(model)
    specs = tp_sharding(model)
    out: dict[str, DTensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        spec = specs.get(key)
        if spec is not None and spec.stride != 1:
            raise ValueError(f"tp_state_dict: '{key}' is split with stride {spec.stride}: no DTensor placement fits")
        placement = Shard(spec.dim) if spec is not None else Replicate()
        local = value.detach() if isinstance(value, torch.Tensor) else value
        out[key] = DTensor.from_local(local, mesh, [placement], run_check=False)
    return out
