"""Reader for ``shardkit checkpoint import``: per-rank model-parallel shard files (``consolidated.0N.pth``).

Meta's Llama checkpoints, and any model written against ``fairscale.nn.model_parallel``, are saved as one
``torch.save`` state dict per model-parallel rank, each split parameter cut along the dimension its layer splits
(:mod:`shardkit.tensor_parallel.shard_files`). The files carry no record of which parameters are split or how, so
the reader takes that from the caller: a :class:`~shardkit.tensor_parallel.ShardSpec` per split name (what
``shardkit.tensor_parallel.tp_sharding(model)`` returns for the model, at any degree), or, by default, Llama's
naming (:data:`LLAMA_SPLIT_DIMS`). Before merging it checks that the ranks 0..N-1 are all there, that every file
has the same names, and that a tensor the layout calls replicated is equal in every file (a file of another
checkpoint, or a wrong layout, is refused rather than merged into wrong weights).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

import torch

from shardkit.checkpoint.errors import CorruptCheckpointError
from shardkit.checkpoint.tools.sources import ImportedState
from shardkit.checkpoint.tools.store import load_mapped
from shardkit.tensor_parallel import ShardSpec, merge_state_dicts

#: Llama's split parameters by the last two parts of their names: column-parallel layers and the vocabulary-split
#: output on dimension 0, row-parallel layers and the ``ParallelEmbedding`` on dimension 1.
LLAMA_SPLIT_DIMS = {
    "attention.wq.weight": 0,
    "attention.wk.weight": 0,
    "attention.wv.weight": 0,
    "feed_forward.w1.weight": 0,
    "feed_forward.w3.weight": 0,
    "output.weight": 0,
    "attention.wo.weight": 1,
    "feed_forward.w2.weight": 1,
    "tok_embeddings.weight": 1,
}
_FILE = re.compile(r"^consolidated\.(\d+)\.pth$")


def is_model_parallel_folder(path: Path) -> bool:
    """Whether ``path`` is a folder whose ``.pth`` files are all named ``consolidated.NN.pth``."""
    files = [p for p in path.iterdir() if p.suffix == ".pth"] if path.is_dir() else []
    return bool(files) and all(_rank(p) >= 0 for p in files)


def _rank(path: Path) -> int:
    """The model-parallel rank in a ``consolidated.NN.pth`` name, or -1 for another file."""
    match = _FILE.match(path.name)
    return int(match.group(1)) if match else -1


def llama_specs(names: list[str]) -> dict[str, ShardSpec]:
    """The split of each of ``names`` under Llama's naming (names not listed are replicated)."""
    specs = {}
    for name in names:
        for suffix, dim in LLAMA_SPLIT_DIMS.items():
            if name == suffix or name.endswith("." + suffix):
                specs[name] = ShardSpec(dim)
    return specs


def _replicated_mismatch(shards: list[dict[str, torch.Tensor]], specs: Mapping[str, ShardSpec]) -> Optional[str]:
    for name, tensor in shards[0].items():
        if name in specs:
            continue
        for rank, shard in enumerate(shards[1:], start=1):
            if shard[name].shape != tensor.shape or not torch.equal(shard[name], tensor):
                return f"{name!r} differs between consolidated.00.pth and consolidated.{rank:02d}.pth"
    return None


def read_model_parallel_shards(path: Path, specs: Optional[Mapping[str, ShardSpec]] = None) -> ImportedState:
    """The full state dict of the ``consolidated.NN.pth`` files in folder ``path``, merged by ``specs`` (Llama's
    naming when None)."""
    numbered = sorted((_rank(p), p) for p in path.iterdir() if _rank(p) >= 0)
    ranks, files = [rank for rank, _ in numbered], [file for _, file in numbered]
    if not files or ranks != list(range(len(files))):
        raise CorruptCheckpointError(f"{path}: shard files for model-parallel ranks {ranks}; 0..N-1 are needed")
    shards = [dict(load_mapped(f, "model-parallel shard")) for f in files]
    for rank, shard in enumerate(shards[1:], start=1):
        if shard.keys() != shards[0].keys():
            extra = sorted(shard.keys() ^ shards[0].keys())[:3]
            raise CorruptCheckpointError(f"{files[rank]} and {files[0]} hold different names (e.g. {extra})")
    specs = llama_specs(list(shards[0])) if specs is None else specs
    mismatch = _replicated_mismatch(shards, specs)
    if mismatch is not None:
        raise CorruptCheckpointError(
            f"{path}: {mismatch}, but the layout says it is replicated: the files come from different checkpoints, "
            "or the layout is not this model's (pass its tensor_parallel.tp_sharding(model))"
        )
    return ImportedState(merge_state_dicts(shards, specs))
