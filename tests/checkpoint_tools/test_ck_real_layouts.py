"""inspect and export on checkpoints written by the real code at world size 2: FSDP's previous layout (DCP
parameters in row chunks from two ranks, optimizer gathered on rank 0) and a universal save_checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from ck_tools_lib import write_meta
from safetensors.torch import load_file
from torch import nn

from shardkit.checkpoint.cli import main
from shardkit.checkpoint.tools.inspect import inspect_checkpoint
from shardkit.testing import run_distributed


def _fsdp_saves(rank: int, world_size: int, root: str) -> dict:
    from shardkit.checkpoint import save_checkpoint
    from shardkit.checkpoint.adapters.fsdp_legacy import FSDPAdapter
    from shardkit.nn import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FSDP(nn.Sequential(FSDP(nn.Linear(6, 10)), nn.ReLU(), nn.Linear(10, 3)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(rank)
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    legacy = Path(root) / "legacy"
    if rank == 0:
        legacy.mkdir(parents=True)
    dist.barrier()
    FSDPAdapter(model, opt).save(legacy, rank)
    dist.barrier()
    if rank == 0:
        write_meta(legacy, "fsdp-dcp", strategy="fsdp", world_size=world_size)
    save_checkpoint(Path(root) / "universal", step=1, model=model, optimizer=opt)
    full = {k: v.clone() for k, v in model.state_dict().items()}
    if rank == 0:  # one rank alone, inside the job: the tools' reads must not become collectives
        from shardkit.checkpoint.tools.export import export_safetensors

        export_safetensors(Path(root) / "universal", Path(root) / "in_job.safetensors")
    dist.barrier()
    return full


def test_real_fsdp_checkpoints_inspect_and_export(tmp_path: Path) -> None:
    full = run_distributed(_fsdp_saves, 2, str(tmp_path), timeout_s=120)[0]
    in_job = load_file(tmp_path / "in_job.safetensors")
    assert all(torch.equal(in_job[k], v) for k, v in full.items())
    for name in ("legacy", "universal"):
        ck = tmp_path / name
        report = inspect_checkpoint(ck)
        assert report["verification"]["ok"] and report["world_size"] == 2
        model = {t["key"].removeprefix("model/"): t for t in report["tensors"] if t["part"] == "model"}
        assert model.keys() == full.keys()
        assert model["0.weight"]["shape"] == [10, 6]
        assert report["layout"] == {"legacy": "fsdp-dcp", "universal": "universal"}[name]
        if name == "legacy":
            assert model["0.weight"]["chunks"] == 2  # one row block per rank
        assert main(["export", str(ck), str(tmp_path / f"{name}.safetensors")]) == 0
        exported = load_file(tmp_path / f"{name}.safetensors")
        assert exported.keys() == full.keys()
        for key, tensor in full.items():
            assert torch.equal(exported[key], tensor), (name, key)
