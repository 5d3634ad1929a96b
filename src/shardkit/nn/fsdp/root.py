"""What the root of a tree of wrapped units sets up at its first forward.

The outermost :class:`~shardkit.nn.fsdp.FullyShardedDataParallel` to run forward becomes the root: it names
every unit by its path, links the nested units to itself, plans and creates the reduce channels (every rank runs
the root's first forward at the same point, the one moment process groups can be created) and casts buffers to
their units' buffer dtypes. Everything that could refuse the tree is checked before anything changes.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from shardkit.nn.combinations import refuse_inside_ddp
from shardkit.nn.fsdp.comm_context import CommContext
from shardkit.nn.fsdp.reduce_channels import plan_reduce_channels
from shardkit.nn.fsdp.unit_module import UnitModule, walk_modules


def init_root(root: UnitModule) -> None:
    """Mark ``root`` as the root of its tree and its nested units as non-root (once; later calls do nothing).

    Example (what the first forward of the outermost unit does)::

        init_root(model)   # model: the outermost FullyShardedDataParallel
        assert model.is_root and all(u.root is model.fsdp_unit for u in model.fsdp_unit.units[1:])
    """
    unit = root.fsdp_unit
    if unit.is_root is not None:
        return
    refuse_inside_ddp(inspect.currentframe())  # FSDP deep inside a module DDP wraps (DDP at the top: at DDP's init)
    # Checked before anything changes: units sharing a process group must agree on its reduce channel.
    tree = [(path, m) for path, _, m in walk_modules(root) if isinstance(m, UnitModule)]
    root_name = f"<root {type(root.wrapped_module).__name__}>"
    channel_plan = plan_reduce_channels([(path or root_name, m.fsdp_unit) for path, m in tree])
    unit.is_root, unit.root, unit.units = True, None, []
    unit.name = root_name
    for path, module in tree:
        if module is not root:
            module.fsdp_unit.join_tree(unit, path)
        unit.units.append(module.fsdp_unit)
    # Every rank runs the root's first forward at the same point: the one moment to create process groups.
    unit.comm = CommContext(channel_plan())
    _cast_buffers(root)


def _cast_buffers(root: UnitModule) -> None:
    # A buffer takes the buffer dtype of the innermost unit holding it (None: left as it is), so a
    # full-precision unit inside a mixed-precision root (auto_wrap_bn's BatchNorms) keeps FP32 statistics.
    dtype_of: dict[int, Optional[torch.dtype]] = {}
    tree = [(path, m) for path, _, m in walk_modules(root)]
    for _, unit in tree:
        if isinstance(unit, UnitModule):
            dtype_of.update((id(m), unit.buffer_dtype) for m in unit.wrapped_module.modules())
    for path, module in tree:
        dtype = dtype_of.get(id(module))
        for name, buf in module._buffers.items():
            if dtype is not None and buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                root.buffer_original_dtypes[f"{path}.{name}" if path else name] = buf.dtype
                module._buffers[name] = buf.to(dtype)
