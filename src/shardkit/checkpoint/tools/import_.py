"""``shardkit checkpoint import``: another tool's checkpoint as a shardkit universal checkpoint.

Sources (``--format``, detected when ``auto``):

==================  ===================================================================================
``state-dict``      a file written by ``torch.save(model.state_dict())`` (or a dict holding it: ``--key``)
``fairscale-full``  fairscale FSDP's consolidated ``state_dict()`` (wrapper levels in names removed)
``safetensors``     a ``.safetensors`` file, or a folder of them (Hugging Face shards with their index)
``torch-dcp``       a torch.distributed.checkpoint folder from torch FSDP / FSDP2 ``get_state_dict``
                    (model and, when present, optimizer state by parameter name with hyper-parameters)
``fairscale-shards`` a folder with one fairscale FSDP local-shard file per rank (see :mod:`~.sources`)
==================  ===================================================================================

The result is a universal checkpoint at step ``step`` (0 by default), saved at world size 1, which
``load_checkpoint`` loads into any strategy at any world size.

Example::

    import_checkpoint("pytorch_model.bin", "runs/imported")
    info = load_checkpoint("runs/imported", model=model)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from shardkit.checkpoint.tools.sources import (
    ImportedState,
    read_fairscale_shards,
    read_safetensors,
    read_state_dict,
)
from shardkit.checkpoint.tools.torch_dcp import read_torch_dcp

FORMATS = ("state-dict", "fairscale-full", "safetensors", "torch-dcp", "fairscale-shards")


def detect_format(source: Path) -> str:
    """The format of ``source`` (one of :data:`FORMATS`), or a ValueError saying what was found."""
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist")
    if source.is_file():
        return "safetensors" if source.suffix == ".safetensors" else "state-dict"
    if (source / ".metadata").is_file():
        return "torch-dcp"
    if any(source.glob("*.safetensors")):
        return "safetensors"
    if any(source.glob("*.pt")) or any(source.glob("*.pth")):
        return "fairscale-shards"
    raise ValueError(
        f"{source} is neither a torch.save file, a safetensors file or folder, a DCP checkpoint (.metadata) nor a "
        "folder of fairscale shard files; pass --format"
    )


def read_source(source: Union[str, Path], source_format: str = "auto", key: Optional[str] = None) -> ImportedState:
    """The tensors of ``source`` by the unwrapped model's names (and optimizer state where the format has it)."""
    path = Path(source)
    kind = detect_format(path) if source_format == "auto" else source_format
    if kind not in FORMATS:
        raise ValueError(f"unknown source format {kind!r}; choose one of {', '.join(FORMATS)}")
    if key is not None and kind not in ("state-dict", "fairscale-full"):
        raise ValueError("--key applies to torch.save state dict files only")
    if kind in ("state-dict", "fairscale-full"):
        return read_state_dict(path, key)
    if kind == "safetensors":
        return read_safetensors(path)
    if kind == "torch-dcp":
        return read_torch_dcp(path)
    files = sorted(p for p in path.iterdir() if p.suffix in (".pt", ".pth")) if path.is_dir() else [path]
    return read_fairscale_shards(files)


def import_checkpoint(
    source: Union[str, Path],
    directory: Union[str, Path],
    *,
    step: int = 0,
    source_format: str = "auto",
    key: Optional[str] = None,
) -> Path:
    """Read ``source`` and write it as a universal checkpoint in ``directory``; returns the directory."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"--step must be a non-negative integer, got {step!r}")
    state = read_source(source, source_format, key)
    return write_universal(state, Path(directory), step)


class _ImportedOptimizer(torch.optim.Optimizer):
    """Carries imported optimizer state and hyper-parameters to ``save_checkpoint``; it cannot step."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        super().__init__(groups, defaults={})

    def step(self, closure: Any = None) -> Any:
        raise RuntimeError("an imported optimizer state only travels into a checkpoint; it cannot step")


def holder_module(tensors: dict[str, torch.Tensor]) -> tuple[nn.Module, dict[str, nn.Parameter]]:
    """A module whose ``state_dict()`` is ``tensors`` (same names; the tensors themselves, not copies), and its
    parameters by name. Floating tensors become parameters, the others buffers; one tensor object under two
    names becomes one tied parameter."""
    root = nn.Module()
    params: dict[str, nn.Parameter] = {}
    by_object: dict[int, nn.Parameter] = {}
    for fqn, tensor in tensors.items():
        *path, leaf = fqn.split(".")
        if not leaf or not all(path):
            raise ValueError(f"tensor name {fqn!r} has an empty part; it is not a module parameter name")
        module = root
        for part in path:
            child = getattr(module, part, None)
            if child is None:
                child = nn.Module()
                module.add_module(part, child)
            if not isinstance(child, nn.Module):
                raise ValueError(f"{fqn!r}: {part!r} is both a tensor and a module in the source")
            module = child
        if not tensor.is_floating_point():
            module.register_buffer(leaf, tensor)
            continue
        param = by_object.get(id(tensor))
        if param is None:
            param = by_object[id(tensor)] = nn.Parameter(tensor, requires_grad=False)
        module.register_parameter(leaf, param)
        params[fqn] = param
    return root, params


def _optimizer(state: ImportedState, params: dict[str, nn.Parameter]) -> Optional[torch.optim.Optimizer]:
    """The imported optimizer state on the holder's parameters, one param group per distinct hyper-parameters."""
    if not state.optim_state:
        return None
    groups: list[dict[str, Any]] = []
    for fqn in state.optim_state:
        if fqn not in params:
            raise ValueError(f"optimizer state for {fqn!r}, which is not a floating-point model tensor")
        hparams = dict(state.optim_hparams.get(fqn, {}))
        same = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == hparams), None)
        if same is None:
            groups.append({**hparams, "params": [params[fqn]]})
        else:
            same["params"].append(params[fqn])
    optimizer = _ImportedOptimizer(groups)
    for fqn, values in state.optim_state.items():
        optimizer.state[params[fqn]] = dict(values)
    return optimizer


def write_universal(state: ImportedState, directory: Path, step: int) -> Path:
    """Write ``state`` with ``save_checkpoint`` from this one process, keyed by the source's names.

    The tensors are handed over as they are (memory-mapped where the source allows), not copied.
    """
    import torch.distributed as dist

    from shardkit.checkpoint.api import save_checkpoint

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("import a checkpoint from one process (it runs without a process group), not from a job")
    model, params = holder_module(state.model)
    return save_checkpoint(directory, step=step, model=model, optimizer=_optimizer(state, params))
