"""smp v1.6+ names AWS's large-model scripts use, without tensor parallelism (issue 34), in one process:
the config keys they pass, ``smp.model_creation``, ``smp.set_partition``, the tp/rdp helpers, the FP16-optimizer
names, ``model.module``, and configs and NumPy values in ``user_content``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from smp_testlib import AWS_GPT2_CONFIG
from torch import nn

import shardkit.modelparallel as smp
from shardkit.modelparallel.checkpoints.user_content import decode, encode
from shardkit.modelparallel.partition import manual_assignment
from shardkit.modelparallel.tp.registry import Mark, mark_of

#: The config AWS's GPT-2 script passes, with the keys train.py adds.
SCRIPT_CONFIG: dict[str, Any] = {
    **AWS_GPT2_CONFIG,
    "auto_partition": False,
    "ddp_dist_backend": "auto",
    "sdp_hierarchical_allgather": False,
    "sdp_gradient_clipping": 1.0,
    "active_microbatches": 2,
}


@contextlib.contextmanager
def _smp(config: dict[str, Any]) -> Iterator[None]:
    smp.reset()
    smp.init(config)
    try:
        yield
    finally:
        smp.reset()


@pytest.mark.parametrize("delayed", [False, True])
def test_the_scripts_config_is_accepted(delayed: bool) -> None:
    with _smp({**SCRIPT_CONFIG, "delayed_parameter_initialization": delayed}):
        assert smp.ModelParallelConfig.from_dict(SCRIPT_CONFIG).delayed_parameter_initialization
        with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, dtype=torch.float32):
            layer = nn.Linear(2, 2)
        assert layer.weight.is_meta == delayed


def test_model_creation_applies_the_dtype_and_marks_for_tensor_parallelism() -> None:
    with _smp({"delayed_parameter_initialization": False}):
        before = torch.get_default_dtype()
        with smp.model_creation(tensor_parallelism=False, dtype=torch.bfloat16, distribute_embedding=False):
            layer = nn.Linear(2, 2)
        assert layer.weight.dtype == torch.bfloat16 and torch.get_default_dtype() == before
        with smp.model_creation(True, distribute_embedding=True):
            marked = nn.Linear(2, 2)
        assert mark_of(marked) == Mark(True, {"distribute_embedding": True}) and mark_of(layer) is None
        with pytest.raises(TypeError, match="floating-point"), smp.model_creation(dtype=torch.int64):
            pass


def test_set_partition_places_a_module_and_its_unmarked_descendants() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Linear(2, 2))
    smp.set_partition(net[1], 1)  # before smp.init: the index is checked against the config at the partition
    assert manual_assignment(net, partitions=2, default_partition=0) == {
        "": 0,
        "0": 0,
        "1": 1,
        "1.0": 1,
        "1.1": 1,
        "2": 0,
    }
    smp.set_partition(net[1][1], 0)  # the last call on a module wins over what it inherited
    assert manual_assignment(net, partitions=2, default_partition=0)["1.1"] == 0
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        smp.set_partition("net", 0)  # type: ignore[arg-type]


def test_tensor_parallel_helpers_at_degree_one(single: None) -> None:
    assert smp.get_tp_group() == [smp.rank()] and 0 in smp.get_tp_group()
    assert smp.get_pp_group() == smp.get_mp_group() and smp.get_rdp_group() == smp.get_dp_group()
    assert (smp.tp_rank(), smp.tp_size(), smp.rdp_size(), smp.dp_size()) == (0, 1, 1, 1)


def _fp16_names_run(max_norm: float) -> tuple[list[float], list[float], Any]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    reference = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    reference.load_state_dict(net.state_dict())
    model = smp.DistributedModel(net)
    assert model.module is net
    optimizer = smp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5),
        static_loss_scale=None,
        dynamic_loss_scale=True,
        dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2},
    )
    assert [len(g) for g in optimizer.fp16_groups] == [4] and optimizer.overflow is False
    plain = torch.optim.SGD(reference.parameters(), lr=0.5)

    @smp.step
    def train(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    ours, theirs, norms = [], [], []
    for step in range(3):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step)) * 3
        y = torch.ones(4, 1) * 5
        optimizer.zero_grad()
        ours.append(train(model, x, y).reduce_mean().item())
        norms.append(optimizer.clip_master_grads(max_norm).item())
        optimizer.step()
        plain.zero_grad()
        losses = [torch.nn.functional.mse_loss(reference(xm), ym) for xm, ym in zip(x.chunk(2), y.chunk(2))]
        loss = sum(losses) / 2
        loss.backward()  # type: ignore[union-attr]
        theirs.append(loss.item())  # type: ignore[union-attr]
        norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm).item())
        plain.step()
    return ours, theirs, norms


def test_fp16_optimizer_names_and_clip_master_grads_match_torch(single: None) -> None:
    ours, theirs, norms = _fp16_names_run(max_norm=0.5)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-6, (ours, theirs)
    assert all(abs(a - b) <= 1e-5 * max(1.0, b) for a, b in zip(norms[0::2], norms[1::2])), norms
    assert max(norms) > 0.5  # the clipping was active


def test_user_content_with_a_config_and_numpy_values_round_trips(single: None, tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)
    content = {
        "cli_args": {"lr": 0.1, "seed": 3},
        "num_params": np.prod((3, 5)),  # numpy.int64, as the script's compute_num_params returns
        "model_config": config,
        "mask": np.arange(4, dtype=np.float32),
        "lr_scheduler": {"num_iters": np.float64(2.5)},
    }
    encoded = encode(content)
    assert type(encoded["num_params"]) is int and type(encoded["lr_scheduler"]["num_iters"]) is float
    model = smp.DistributedModel(nn.Linear(2, 2))
    smp.save_checkpoint(str(tmp_path), tag="full", partial=False, model=model, user_content=content)
    loaded = smp.resume_from_checkpoint(str(tmp_path), tag="full", partial=False, load_optimizer=False)
    assert loaded["num_params"] == 15 and loaded["cli_args"] == {"lr": 0.1, "seed": 3}
    assert type(loaded["model_config"]) is transformers.GPT2Config
    assert loaded["model_config"].to_dict() == config.to_dict()
    assert isinstance(loaded["mask"], np.ndarray) and loaded["mask"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert decode(encoded)["model_config"].n_embd == 32
    with pytest.raises(TypeError, match="user_content must hold only"):
        smp.save_checkpoint(str(tmp_path), tag="bad", partial=False, model=model, user_content={"f": object()})
