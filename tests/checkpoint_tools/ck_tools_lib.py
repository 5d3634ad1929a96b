"""Shared pieces of the ``shardkit checkpoint`` tests: hand-made checkpoints of each layout (written with torch's
own DCP and torch.save plus a meta.json with real digests), so the tools are tested on exactly the files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import shardkit
from shardkit.checkpoint.metadata import CheckpointMeta, record_files
from shardkit.checkpoint.universal.layout import DCP_DIR


def write_meta(directory: Path, layout: str, strategy: str = "plain", step: int = 3, world_size: int = 1) -> None:
    """A meta.json recording every file under ``directory`` with its size and SHA-256."""
    files = record_files(directory)
    meta = CheckpointMeta(
        step=step,
        world_size=world_size,
        strategy=strategy,
        layout=layout,
        resizable=True,
        has_optimizer=True,
        has_scaler=False,
        shardkit_version=shardkit.__version__,
        torch_version=torch.__version__,
        files=files,
    )
    (directory / "meta.json").write_text(json.dumps(meta.to_json()))


def dcp_save(state: dict[str, Any], path: Path) -> None:
    """``dcp.save`` in this process (no process group)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def universal_checkpoint(directory: Path, model: dict[str, torch.Tensor], optim: dict[str, torch.Tensor]) -> Path:
    """A universal-layout checkpoint: one DCP store with ``model/<fqn>`` and ``optim/<fqn>/<name>`` keys."""
    state = {f"model/{k}": v for k, v in model.items()} | {f"optim/{k}": v for k, v in optim.items()}
    dcp_save(state, directory / DCP_DIR)
    write_meta(directory, "universal")
    return directory


def full_checkpoint(directory: Path, model: dict[str, torch.Tensor], optimizer_state: dict[str, Any]) -> Path:
    """Today's "full" layout: model.pt and optimizer.pt written with torch.save."""
    directory.mkdir(parents=True)
    torch.save(model, directory / "model.pt")
    torch.save(optimizer_state, directory / "optimizer.pt")
    write_meta(directory, "full")
    return directory


def fsdp_dcp_checkpoint(directory: Path, model: dict[str, torch.Tensor], optimizer_state: dict[str, Any]) -> Path:
    """Today's "fsdp-dcp" layout: a DCP store model/ keyed by the model's names, plus optimizer.pt."""
    dcp_save(dict(model), directory / "model")
    torch.save(optimizer_state, directory / "optimizer.pt")
    write_meta(directory, "fsdp-dcp", strategy="fsdp")
    return directory


def small_state() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A model state (two layers and an int buffer) and Adam-like optimizer state by name."""
    g = torch.Generator().manual_seed(1)
    model = {
        "enc.weight": torch.randn(6, 5, generator=g),
        "enc.bias": torch.randn(6, generator=g),
        "head.weight": torch.randn(3, 6, generator=g),
        "norm.num_batches_tracked": torch.tensor(7),
    }
    optim = {"enc.weight/exp_avg": torch.randn(6, 5, generator=g), "enc.weight/step": torch.tensor(4.0)}
    return model, optim


def ck_net() -> nn.Module:
    """A small model with a BatchNorm (buffers beside parameters) for the import and export tests."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3))


# fairscale FSDP local shards, built the way fairscale lays them out (see sources.py's docstring): each FSDP
# instance flattens its own parameters into flat_param_0, pads it to a multiple of the world size, and every
# rank keeps chunk ``rank`` (torch.chunk sizes; the short last chunks padded at their end).


def write_fairscale_shards(model: nn.Module, world_size: int, folder: Path) -> None:
    """fairscale FSDP local-state-dict shard files of ``model`` (two units) as ``world_size`` ranks would write them."""
    units = {"0": ["weight", "bias"], "": ["1.weight", "1.bias", "2.weight", "2.bias"]}  # inner unit, root
    sd = model.state_dict()
    weights: list[dict] = [{} for _ in range(world_size)]
    metas: list[dict] = [{"param_metadata": [], "buffer_names": []} for _ in range(world_size)]
    for path, names in units.items():
        full = [sd[f"{path}.{n}" if path else n] for n in names]
        flat = torch.cat([t.reshape(-1) for t in full])
        chunks = flat.chunk(world_size)
        size = chunks[0].numel()
        for rank in range(world_size):
            piece = chunks[rank] if rank < len(chunks) else flat[:0]
            pad = size - piece.numel()
            raw = (
                ("_fsdp_wrapped_module._fpw_module." + path + "._fsdp_wrapped_module.")
                if path
                else "_fsdp_wrapped_module."
            )
            weights[rank][raw + "flat_param_0"] = torch.cat([piece, piece.new_zeros(pad)])
            metas[rank]["param_metadata"].append(
                {
                    "fsdp_path": path,
                    "params": {
                        "flat_param_0": {
                            "names": names,
                            "shapes": [t.shape for t in full],
                            "numels": [t.numel() for t in full],
                            "padding": pad,
                        }
                    },
                    "no_broadcast_optim_state": False,
                    "shared_param_info": [],
                }
            )
    for rank in range(world_size):
        for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
            weights[rank][name] = sd[name]
        metas[rank]["buffer_names"] = ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
        torch.save({"model": weights[rank], "shard_metadata": metas[rank]}, folder / f"checkpoint-shard{rank}.pt")
