"""``shardkit checkpoint import``: another tool's checkpoint as a shardkit universal checkpoint.

Sources (``--format``, detected when ``auto``):

==================  ===================================================================================
``state-dict``      a file written by ``torch.save(model.state_dict())`` (or a dict holding it: ``--key``)
``fairscale-full``  fairscale FSDP's consolidated ``state_dict()`` (wrapper levels in names removed)
``safetensors``     a ``.safetensors`` file, or a folder of them (Hugging Face shards with their index)
``torch-dcp``       a torch.distributed.checkpoint folder from torch FSDP / FSDP2 ``get_state_dict``
                    (model and, when present, optimizer state by parameter name with hyper-parameters)
``fairscale-shards`` a folder with one fairscale FSDP local-shard file per rank (see :mod:`~.sources`)
``model-parallel-shards`` a folder of ``consolidated.NN.pth`` files, one per model-parallel rank (Meta's Llama
                    checkpoints; split by Llama's names, or by ``shard_specs``: see :mod:`~.model_parallel`)
==================  ===================================================================================

The result is a universal checkpoint at step ``step`` (0 by default), saved at world size 1 with strategy
``"import"``, which ``load_checkpoint`` loads into any strategy at any world size. Memory: a ``torch.save``
state dict stays memory-mapped until it is written; the other sources are read into memory whole before the
write (the model, plus the optimizer state of a torch DCP source).

Example::

    import_checkpoint("pytorch_model.bin", "runs/imported")
    info = load_checkpoint("runs/imported", model=model)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Optional, Union

from shardkit.checkpoint.tools.model_parallel import is_model_parallel_folder, read_model_parallel_shards
from shardkit.checkpoint.tools.sources import (
    ImportedState,
    read_fairscale_shards,
    read_safetensors,
    read_state_dict,
)
from shardkit.checkpoint.tools.torch_dcp import read_torch_dcp
from shardkit.checkpoint.tools.write import whole, write_state
from shardkit.tensor_parallel import ShardSpec

FORMATS = ("state-dict", "fairscale-full", "safetensors", "torch-dcp", "fairscale-shards", "model-parallel-shards")


def detect_format(source: Path) -> str:
    """The format of ``source`` (one of :data:`FORMATS`), or a ValueError saying what was found."""
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist")
    if source.is_file():
        if source.suffix == ".safetensors":
            return "safetensors"
        require_torch_save_file(source)
        return "state-dict"
    if (source / ".metadata").is_file():
        return "torch-dcp"
    if any(source.glob("*.safetensors")):
        return "safetensors"
    if is_model_parallel_folder(source):
        return "model-parallel-shards"
    if any(source.glob("*.pt")) or any(source.glob("*.pth")):
        return "fairscale-shards"
    raise ValueError(
        f"{source} is neither a torch.save file, a safetensors file or folder, a DCP checkpoint (.metadata) nor a "
        "folder of fairscale shard files; pass --format"
    )


#: How a ``torch.save`` file begins: a zip archive (torch >= 1.6), or the legacy format's pickle (protocol 2+).
_TORCH_SAVE_HEADS = (b"PK\x03\x04", b"\x80")
#: How a safetensors file begins after its 8-byte header length: the JSON header.
_SAFETENSORS_HEAD = b"{"


def require_torch_save_file(source: Path) -> None:
    """Raise a ValueError unless ``source`` begins as a ``torch.save`` file does (a zip archive, or a pickle).

    Without this, any other file reaches ``torch.load(weights_only=True)``, whose refusal of the bytes it
    misreads as pickle opcodes says the file "holds pickled Python objects": true of no random file."""
    with open(source, "rb") as f:
        head = f.read(9)
    if head.startswith(_TORCH_SAVE_HEADS):
        return
    looks = " (it looks like a safetensors file: name it *.safetensors)" if head[8:9] == _SAFETENSORS_HEAD else ""
    raise ValueError(
        f"{source} is not a torch or safetensors checkpoint: a torch.save file begins as a zip archive (PK) or a "
        f"pickle, and this one begins with the bytes {head[:4].hex(' ')}{looks}. shardkit checkpoint "
        "import reads a torch.save state dict (.pt/.bin), safetensors, a DCP checkpoint folder, fairscale shard "
        "files or model-parallel shard files"
    )


def read_source(
    source: Union[str, Path],
    source_format: str = "auto",
    key: Optional[str] = None,
    shard_specs: Optional[Mapping[str, ShardSpec]] = None,
) -> ImportedState:
    """The tensors of ``source`` by the unwrapped model's names (and optimizer state where the format has it).

    ``shard_specs`` says how model-parallel shard files split each parameter (Llama's names when None)."""
    path = Path(source)
    kind = detect_format(path) if source_format == "auto" else source_format
    if kind not in FORMATS:
        raise ValueError(f"unknown source format {kind!r}; choose one of {', '.join(FORMATS)}")
    if key is not None and kind not in ("state-dict", "fairscale-full"):
        raise ValueError("--key applies to torch.save state dict files only")
    if kind in ("state-dict", "fairscale-full"):
        if path.is_file():
            require_torch_save_file(path)
        return read_state_dict(path, key)
    if kind == "safetensors":
        return read_safetensors(path)
    if kind == "torch-dcp":
        return read_torch_dcp(path)
    if kind == "model-parallel-shards":
        return read_model_parallel_shards(path, shard_specs)
    files = sorted(p for p in path.iterdir() if p.suffix in (".pt", ".pth")) if path.is_dir() else [path]
    return read_fairscale_shards(files)


def import_checkpoint(
    source: Union[str, Path],
    directory: Union[str, Path],
    *,
    step: int = 0,
    source_format: str = "auto",
    key: Optional[str] = None,
    shard_specs: Optional[Mapping[str, ShardSpec]] = None,
) -> Path:
    """Read ``source`` and write it as a universal checkpoint in ``directory``; returns the directory.

    ``shard_specs`` (model-parallel shard files only): how each parameter is split, e.g.
    ``shardkit.tensor_parallel.tp_sharding(model)``; Llama's naming when None."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"--step must be a non-negative integer, got {step!r}")
    state = read_source(source, source_format, key, shard_specs)
    return write_universal(state, Path(directory), step)


def write_universal(state: ImportedState, directory: Path, step: int) -> Path:
    """Write ``state`` with the engine's single-process writer (:func:`~shardkit.checkpoint.tools.write.
    write_state`): every tensor whole under its name, optimizer state and its group's settings by name.

    The tensors are handed over as they are (memory-mapped where the source allows), not copied.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("import a checkpoint from one process (it runs without a process group), not from a job")
    unknown = [fqn for fqn in state.optim_state if fqn not in state.model]
    if unknown:
        raise ValueError(f"optimizer state for {unknown[:3]}, which the model state does not hold")
    held = [whole(fqn, tensor) for fqn, tensor in state.model.items()]
    optimizer_state = state.optim_state or None
    hyper = {fqn: dict(state.optim_hparams.get(fqn, {})) for fqn in state.optim_state} if optimizer_state else None
    return write_state(directory, held, optimizer_state, hyper, step=step)
