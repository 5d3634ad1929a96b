"""A tensor-parallel model saved through its DTensor view (``tp_state_dict``) with torch.distributed.checkpoint:
each rank writes only its shards, and the checkpoint loads at another model-parallel degree, in place."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from llama_mp import ModelArgs, Transformer, random_full_state

import shardkit.nn.model_parallel as mp
from shardkit import tensor_parallel as tp
from shardkit.testing import run_distributed


def _at_degree(degree: int, full: dict[str, torch.Tensor], specs: dict[str, tp.ShardSpec]) -> Transformer:
    mp.destroy_model_parallel()
    mp.initialize_model_parallel(degree)
    model = Transformer(ModelArgs())
    model.load_state_dict(tp.split_state_dict(full, specs, degree)[mp.get_model_parallel_rank()])
    return model


def _empty_at_degree(degree: int) -> Transformer:
    mp.destroy_model_parallel()
    mp.initialize_model_parallel(degree)
    model = Transformer(ModelArgs())
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    return model


def _reshard(rank: int, world_size: int, directory: str) -> dict[str, float]:
    mp.initialize_model_parallel(1)
    unsplit = Transformer(ModelArgs())
    full, specs = random_full_state(unsplit, seed=3), tp.tp_sharding(unsplit)
    errors = {}
    for saved, loaded in ((2, 1), (1, 2)):
        where = f"{directory}/tp{saved}"
        dcp.save(tp.tp_state_dict(_at_degree(saved, full, specs)), checkpoint_id=where)
        model = _empty_at_degree(loaded)
        dcp.load(tp.tp_state_dict(model), checkpoint_id=where)  # the DTensors view the parameters: loads in place
        want = tp.split_state_dict(full, specs, loaded)[mp.get_model_parallel_rank()]
        errors[f"tp {saved} -> {loaded}"] = max((model.state_dict()[k] - v).abs().max().item() for k, v in want.items())
    return errors


def test_a_dcp_checkpoint_of_the_dtensor_view_loads_at_another_model_parallel_degree(tmp_path: Path) -> None:
    for errors in run_distributed(_reshard, 2, str(tmp_path)):
        assert errors == {"tp 2 -> 1": 0.0, "tp 1 -> 2": 0.0}, errors
