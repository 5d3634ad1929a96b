"""CPU offload brings the caller's batch to the compute device it chose (a GPU on a GPU host).

CPU cannot show a GPU, so the compute device here is ``meta``: like a GPU, it is not where the model and the batch
were built, and a CPU tensor meeting a meta weight fails just as a CPU tensor meeting a CUDA weight does.
"""

from __future__ import annotations

import torch
from torch import nn

from shardkit.distributed import DummyProcessGroup
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.nn.fsdp.input_cast import make_input_mover

ONE = DummyProcessGroup(rank=0, size=1)


def test_offload_moves_host_inputs_to_the_compute_device() -> None:
    model = FSDP(nn.Linear(2, 3), process_group=ONE, cpu_offload=True, compute_device="meta")
    out = model(torch.ones(4, 2))  # before: a device-mismatch error (input on cpu, weight on meta)
    assert out.device.type == "meta" and out.shape == (4, 3)


def test_offload_on_the_host_leaves_inputs_where_they_are() -> None:
    model = FSDP(nn.Linear(2, 3), process_group=ONE, cpu_offload=True, compute_device="cpu")
    x = torch.ones(4, 2)
    assert torch.allclose(model(x), x @ model.module.weight.T.detach() + model.module.bias.detach())


def test_mover_moves_every_tensor_of_a_nested_input() -> None:
    move = make_input_mover(torch.device("meta"))
    args, kwargs = move(((torch.ones(1), 3), {"mask": torch.zeros(2, dtype=torch.bool), "n": None}))
    assert args[0].device.type == "meta" and args[1] == 3
    assert kwargs["mask"].device.type == "meta" and kwargs["mask"].dtype == torch.bool and kwargs["n"] is None
