"""Import reader for torch DCP checkpoints written by torch FSDP2 (``fully_shard`` on gloo CPU, world size 2)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shardkit.checkpoint.tools.import_ import detect_format, read_source
from shardkit.testing import run_distributed


def _fsdp2_train_and_save(rank: int, world_size: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, betas=(0.8, 0.9))
    for step in range(2):
        torch.manual_seed(10 + step * world_size + rank)
        model(torch.randn(4, 5)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    full = {k: v.full_tensor() for k, v in msd.items()}
    state = {
        fqn: {n: (t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in s.items()}
        for fqn, s in osd["state"].items()
    }
    return {"model": full, "state": state}


def test_fsdp2_model_and_optimizer_state_by_name(tmp_path: Path) -> None:
    path = tmp_path / "torch_dcp"
    want = run_distributed(_fsdp2_train_and_save, 2, str(path))[0]
    assert detect_format(path) == "torch-dcp"
    got = read_source(path)
    assert got.model.keys() == want["model"].keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, tensor in want["model"].items():
        assert torch.equal(got.model[name], tensor)
    assert got.optim_state.keys() == want["state"].keys()
    for fqn, state in want["state"].items():
        assert got.optim_state[fqn].keys() == {"exp_avg", "exp_avg_sq", "step"}
        for name, tensor in state.items():
            assert torch.equal(got.optim_state[fqn][name], tensor), (fqn, name)
    assert got.optim_hparams["2.bias"]["lr"] == 0.02 and tuple(got.optim_hparams["2.bias"]["betas"]) == (0.8, 0.9)

    # import, then load into a plain model and optimizer: weights and Adam state arrive by name
    from shardkit.checkpoint import load_checkpoint
    from shardkit.checkpoint.cli import main

    assert main(["import", str(path), str(tmp_path / "ck")]) == 0
    torch.manual_seed(5)
    plain = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    opt = torch.optim.AdamW(plain.parameters(), lr=0.02, betas=(0.8, 0.9))
    load_checkpoint(tmp_path / "ck", model=plain, optimizer=opt)
    for name, param in plain.named_parameters():
        assert torch.equal(param.detach(), want["model"][name])
        for key, tensor in want["state"][name].items():
            assert torch.equal(opt.state[param][key], tensor), (name, key)


def _load_into_shardkit_fsdp(rank: int, world_size: int, ck: str) -> dict:
    from shardkit.checkpoint import load_checkpoint
    from shardkit.nn import FullyShardedDataParallel as FSDP
    from shardkit.nn.fsdp import state_dict as fsdp_state

    torch.manual_seed(7)  # other weights than the source's
    model = FSDP(nn.Sequential(FSDP(nn.Linear(5, 7)), nn.ReLU(), nn.Linear(7, 3)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, betas=(0.8, 0.9))
    load_checkpoint(ck, model=model, optimizer=opt)
    full_optim = fsdp_state.gather_full_optim_state_dict(model, opt, recipient_rank=0)
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optim": full_optim}


def test_torch_fsdp2_checkpoint_resumes_in_shardkit_fsdp(tmp_path: Path) -> None:
    from shardkit.checkpoint.cli import main

    path = tmp_path / "torch_dcp"
    want = run_distributed(_fsdp2_train_and_save, 2, str(path))[0]
    assert main(["import", str(path), str(tmp_path / "ck"), "--step", "2"]) == 0
    got = run_distributed(_load_into_shardkit_fsdp, 2, str(tmp_path / "ck"))[0]
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    names = list(want["model"])  # the unwrapped model's parameter order, which the full optimizer state uses
    state = got["optim"]["state"]
    for index, name in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[index][key].view(-1), want["state"][name][key].view(-1)), (name, key)
