"""OSS's mistakes name OSS and its own arguments (issue 23, item 8): a misspelt keyword, no process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.optim import OSS


def test_a_misspelt_argument_names_oss_and_what_it_takes() -> None:
    with pytest.raises(TypeError) as info:
        OSS(nn.Linear(2, 2).parameters(), optim=torch.optim.SGD, lr=0.1, brodcast_fp16=True)
    message = str(info.value)
    assert "OSS got unexpected keyword argument(s) ['brodcast_fp16'] (did you mean 'broadcast_fp16'?)" in message
    assert "group, broadcast_buffer_size, broadcast_fp16, force_broadcast_object" in message
    assert "optim=SGD, which takes lr, momentum" in message


def test_arguments_of_the_wrapped_class_still_pass() -> None:
    from shardkit.distributed import DummyProcessGroup

    optimizer = OSS(
        nn.Linear(2, 2).parameters(), optim=torch.optim.AdamW, group=DummyProcessGroup(0, 1), lr=0.1, betas=(0.8, 0.9)
    )
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.9)


def test_without_a_process_group_the_advice_uses_oss_argument_name() -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError) as info:
        OSS(nn.Linear(2, 2).parameters(), optim=torch.optim.SGD, lr=0.1)
    message = str(info.value)
    assert "OSS(group=DummyProcessGroup(rank=0, size=1), ...)" in message
    assert "process_group=" not in message
