"""The import readers: each source format gives back exactly the tensors that were saved, by the model's names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ck_tools_lib import ck_net, write_fairscale_shards
from safetensors.torch import save_file

from shardkit.checkpoint.errors import CorruptCheckpointError, UnsafeCheckpointError
from shardkit.checkpoint.tools.import_ import detect_format, read_source
from shardkit.checkpoint.tools.sources import clean_name


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_state_dict_file_plain_nested_and_ddp_prefixed(tmp_path: Path) -> None:
    sd = ck_net().state_dict()
    torch.save(sd, tmp_path / "plain.pt")
    torch.save({"model": sd, "epoch": 3}, tmp_path / "nested.pt")
    torch.save({"module." + k: v for k, v in sd.items()}, tmp_path / "ddp.pt")
    torch.save({"weights": sd}, tmp_path / "other.pt")
    for name in ("plain.pt", "nested.pt", "ddp.pt"):
        assert detect_format(tmp_path / name) == "state-dict"
        _same(read_source(tmp_path / name).model, sd)
    _same(read_source(tmp_path / "other.pt", key="weights").model, sd)


def test_state_dict_with_pickled_code_is_refused(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2), "evil": Path("/tmp")}, tmp_path / "bad.pt")
    with pytest.raises(UnsafeCheckpointError, match="weights_only"):
        read_source(tmp_path / "bad.pt")


def test_safetensors_file_and_hf_shard_folder(tmp_path: Path) -> None:
    sd = {k: v.contiguous() for k, v in ck_net().state_dict().items()}
    save_file(sd, tmp_path / "one.safetensors")
    _same(read_source(tmp_path / "one.safetensors").model, sd)
    folder = tmp_path / "hf"
    folder.mkdir()
    names = list(sd)
    save_file({k: sd[k] for k in names[:3]}, folder / "model-00001-of-00002.safetensors")
    save_file({k: sd[k] for k in names[3:]}, folder / "model-00002-of-00002.safetensors")
    assert detect_format(folder) == "safetensors"
    _same(read_source(folder).model, sd)


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_fairscale_local_shards_consolidate_to_the_full_model(tmp_path: Path, world_size: int) -> None:
    model = ck_net()
    with torch.no_grad():
        model[1].running_mean.uniform_()
    write_fairscale_shards(model, world_size, tmp_path)
    assert detect_format(tmp_path) == "fairscale-shards"
    _same(read_source(tmp_path).model, model.state_dict())


def test_fairscale_missing_rank_and_consolidated_file(tmp_path: Path) -> None:
    model = ck_net()
    write_fairscale_shards(model, 3, tmp_path)
    (tmp_path / "checkpoint-shard1.pt").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"ranks \[0, 2\]"):
        read_source(tmp_path)
    wrapped = {"_fsdp_wrapped_module._fpw_module." + k: v for k, v in model.state_dict().items()}
    torch.save(wrapped, tmp_path / "consolidated.pt")
    _same(read_source(tmp_path / "consolidated.pt", "fairscale-full").model, model.state_dict())


def test_clean_name() -> None:
    assert clean_name("_fsdp_wrapped_module.layers.0._fpw_module.w") == "layers.0.w"
    assert clean_name("blocks.0._checkpoint_wrapped_module.attn.weight") == "blocks.0.attn.weight"


def test_fairscale_shared_params_and_unsharded_units(tmp_path: Path) -> None:
    # unit "": enc.weight (2x3) and enc.bias (2) flattened (8 elements) over 3 ranks: chunks 3, 3, 2 + 1 padding;
    # dec.weight is tied to enc.weight (shared_param_info); unit "expert" keeps a whole, different copy per rank
    # (no_broadcast_optim_state, as fairscale does for MoE experts): rank 0's is the one consolidated.
    enc_w, enc_b = torch.arange(6.0).view(2, 3), torch.tensor([10.0, 11.0])
    flat = torch.cat([enc_w.view(-1), enc_b])
    pieces = [flat[0:3], flat[3:6], torch.cat([flat[6:8], torch.zeros(1)])]
    for rank in range(3):
        expert = torch.full((4,), float(rank))
        weights = {
            "_fsdp_wrapped_module.flat_param_0": pieces[rank],
            "expert._fsdp_wrapped_module.flat_param_0": expert,
        }
        unit = {
            "names": ["enc.weight", "enc.bias"],
            "shapes": [torch.Size([2, 3]), torch.Size([2])],
            "numels": [6, 2],
            "padding": 1 if rank == 2 else 0,
        }
        meta = {
            "param_metadata": [
                {
                    "fsdp_path": "",
                    "params": {"flat_param_0": unit},
                    "no_broadcast_optim_state": False,
                    "shared_param_info": [("enc.weight", "dec.weight")],
                },
                {
                    "fsdp_path": "expert",
                    "params": {
                        "flat_param_0": {"names": ["w"], "shapes": [torch.Size([4])], "numels": [4], "padding": 0}
                    },
                    "no_broadcast_optim_state": True,
                    "shared_param_info": [],
                },
            ],
            "buffer_names": [],
        }
        torch.save({"weights": weights, "meta": meta}, tmp_path / f"rank-{rank}.pt")
    got = read_source(tmp_path).model
    assert set(got) == {"enc.weight", "enc.bias", "dec.weight", "expert.w"}
    assert torch.equal(got["enc.weight"], enc_w) and torch.equal(got["enc.bias"], enc_b)
    assert got["dec.weight"] is got["enc.weight"]  # one tensor under both names, as fairscale gives it
    assert torch.equal(got["expert.w"], torch.zeros(4))
