"""``shardkit checkpoint export``: a checkpoint's model weights as safetensors, with bounded memory.

Tensors are read a shard at a time (each shard at most ``max_shard_bytes``, one tensor larger than that is a shard
of its own) and written with ``safetensors.torch.save_file``; the peak is one shard plus one DCP read buffer, never
the whole model. Output follows Hugging Face's convention: ``model.safetensors`` when everything fits in one shard,
else ``model-00001-of-0000N.safetensors`` files plus ``model.safetensors.index.json`` (``weight_map``: tensor name ->
file), which ``transformers`` and ``safetensors`` users read directly.

Example::

    files = export_safetensors("runs/exp1/step_00000100", "export/", max_shard_bytes=2 << 30)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional, Union

import torch

from shardkit.checkpoint.tools.store import CheckpointView, TensorEntry

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: Default largest shard: also the most memory an export holds at once.
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """Bytes in ``"2GB"``, ``"500MiB"`` or ``"1048576"``; a ValueError saying the accepted forms otherwise."""
    cleaned = text.strip().upper().replace(" ", "")
    for unit in sorted(_UNITS, key=len, reverse=True):
        if cleaned.endswith(unit):
            number = cleaned[: -len(unit)]
            break
    else:
        unit, number = "B", cleaned
    try:
        value = int(float(number) * _UNITS[unit])
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"size {text!r} is not a positive size; write e.g. 2GB, 500MB, 512MiB or a byte count")
    return value


def plan_shards(
    entries: Sequence[TensorEntry], max_shard_bytes: int, dtype: Optional[torch.dtype]
) -> list[list[TensorEntry]]:
    """Group ``entries`` in order into shards of at most ``max_shard_bytes`` (as written, after ``dtype``)."""
    shards: list[list[TensorEntry]] = []
    size = 0
    for entry in entries:
        nbytes = _written_bytes(entry, dtype)
        if not shards or size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _written_bytes(entry: TensorEntry, dtype: Optional[torch.dtype]) -> int:
    if dtype is None or not entry.dtype.is_floating_point:
        return entry.nbytes
    return entry.nbytes // entry.dtype.itemsize * dtype.itemsize


def _cast(tensor: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``tensor`` in ``dtype`` if it is floating point (integer buffers keep their type), contiguous."""
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return tensor.contiguous()


def write_shards(
    view: CheckpointView,
    entries: Sequence[TensorEntry],
    out_dir: Path,
    *,
    names: Optional[Mapping[str, str]] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: Optional[torch.dtype] = None,
    single_file: Optional[Path] = None,
) -> list[Path]:
    """Write ``entries`` of ``view`` as safetensors shards in ``out_dir`` (or as ``single_file``); the files written.

    ``names`` maps an entry's name to the name written (default: unchanged). With ``single_file`` everything must
    fit in one shard, else a ValueError says to export into a folder or raise ``max_shard_bytes``.
    """
    from safetensors.torch import save_file

    names = names or {}
    shards = plan_shards(entries, max_shard_bytes, dtype)
    if single_file is not None and len(shards) > 1:
        total = sum(_written_bytes(e, dtype) for e in entries)
        raise ValueError(
            f"the model has {total} bytes, more than --max-shard-size ({max_shard_bytes} bytes), the most one export "
            f"holds in memory; export into a folder (OUT without .safetensors) to get model-0000x-of-0000y shards, "
            "or raise --max-shard-size"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards):
        if single_file is not None:
            path = single_file
        elif len(shards) == 1:
            path = out_dir / SINGLE_FILE
        else:
            path = out_dir / f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        loaded = view.read_many(list(shard))
        tensors = {names.get(e.name, e.name): _cast(loaded.pop(e.key), dtype) for e in shard}
        save_file(tensors, str(path), metadata={"format": "pt"})
        weight_map.update({name: path.name for name in tensors})
        del tensors, loaded  # the next shard reuses the memory
        files.append(path)
    if len(shards) > 1:
        total = sum(_written_bytes(e, dtype) for e in entries)
        index_obj = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / INDEX_FILE).write_text(json.dumps(index_obj, indent=2) + "\n")
        files.append(out_dir / INDEX_FILE)
    return files


def export_safetensors(
    directory: Union[str, Path],
    out: Union[str, Path],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: Optional[torch.dtype] = None,
) -> list[Path]:
    """The model weights of the checkpoint at ``directory`` as safetensors at ``out``; returns the files written.

    ``out`` ending in ``.safetensors`` is one file (the model must fit in ``max_shard_bytes``); anything else is
    a folder receiving ``model.safetensors`` or HF-style shards with an index. Names are the unwrapped model's
    (``model.state_dict()``'s); ``dtype`` casts floating-point tensors.
    """
    view = CheckpointView.open(directory)
    entries = view.model_entries()
    if not entries:
        raise ValueError(f"{view.directory} holds no model tensors to export")
    out = Path(out)
    if out.suffix == ".safetensors":
        return write_shards(view, entries, out.parent, max_shard_bytes=max_shard_bytes, dtype=dtype, single_file=out)
    return write_shards(view, entries, out, max_shard_bytes=max_shard_bytes, dtype=dtype)
