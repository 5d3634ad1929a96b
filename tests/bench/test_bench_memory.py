"""memory.training_memory counts the bytes a rank holds, each storage once."""

import torch
from torch import nn

from shardkit.memory.meter import MemoryBreakdown, format_bytes, training_memory
from shardkit.testing.models import LMConfig, TransformerLM


def _train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    tokens = torch.randint(0, 64, (2, 16))
    TransformerLM.loss_fn(model(tokens), tokens).backward()
    opt.step()


def test_plain_model_with_adamw_matches_hand_count() -> None:
    model = TransformerLM(LMConfig())  # tied embedding: one tensor shared by embed and head
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    assert numel < sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))

    assert training_memory(model, opt) == MemoryBreakdown(params=4 * numel, grads=0, optim_state=0)
    _train_step(model, opt)
    # AdamW: exp_avg and exp_avg_sq per parameter (fp32), plus a 4-byte fp32 `step` scalar per parameter.
    expected = MemoryBreakdown(params=4 * numel, grads=4 * numel, optim_state=8 * numel + 4 * len(params))
    assert training_memory(model, opt) == expected
    assert expected.total == 16 * numel + 4 * len(params)
    opt.zero_grad()
    assert training_memory(model, opt).grads == 0


def test_views_of_one_flat_buffer_count_once() -> None:
    flat = torch.zeros(30)
    model = nn.Module()
    model.a = nn.Parameter(flat[:10].view(2, 5))
    model.b = nn.Parameter(flat[10:])
    grad_flat = torch.ones(30)
    model.a.grad, model.b.grad = grad_flat[:10].view(2, 5), grad_flat[10:]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert training_memory(model, opt) == MemoryBreakdown(params=120, grads=120, optim_state=0)


class _ShardingWrapper(torch.optim.Optimizer):
    """Like OSS / ZeroRedundancyOptimizer: the rank's shard lives in a local optimizer at ``.optim``."""

    def __init__(self, params: list[nn.Parameter], local: list[nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.1})
        self.optim = torch.optim.Adam(local, lr=0.1)

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        return self.optim.step(closure)


def test_sharded_optimizer_counts_only_the_local_shard() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    local = list(model[0].parameters())  # this rank owns the first layer's state only
    opt = _ShardingWrapper(list(model.parameters()), local)
    model(torch.randn(3, 10)).sum().backward()
    opt.step()
    local_numel = sum(p.numel() for p in local)
    assert training_memory(model, opt).optim_state == 8 * local_numel + 4 * len(local)


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 1024 * 1024) == "3.0 MiB"
    assert format_bytes(5 * 1024**4) == "5120.0 GiB"
