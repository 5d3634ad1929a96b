"""Reference models for parity tests, benchmarks, the planner and the demo.

Each model is small, deterministic given a seed, and exercises something sharding code gets wrong:

- :class:`TransformerLM` - GPT-style decoder; input embedding tied to the output projection.
- :class:`NestedWrappedModule` - a tree of Linear layers nested a few levels deep; ``wrap_fn`` lets a test
  wrap inner pieces (for example with FSDP) while the model is built.
- :class:`BatchNormNet` - BatchNorm running statistics are buffers that must stay in sync.
- :class:`MixtureOfExperts` - shared layers plus an expert whose parameters differ per rank.

``make_batch(model_name, rank, step)`` style helpers give every rank its own deterministic data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.utils.checks import at_least

ModuleFn = Callable[[nn.Module], nn.Module]


def _identity(module: nn.Module) -> nn.Module:
    return module


@dataclass(frozen=True)
class LMConfig:
    """Shape of a :class:`TransformerLM`.

    The default is a tiny model for tests; :meth:`bench` is the GPT-style model of the benchmarks.
    """

    vocab_size: int = 64
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    seq_len: int = 16
    dropout: float = 0.0
    tie_weights: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "seq_len"):
            at_least(self, name, getattr(self, name), 1)
        if self.d_model % self.n_heads:
            raise ValueError(f"LMConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LMConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @classmethod
    def bench(cls) -> LMConfig:
        """8 blocks, width 512, 8 heads, vocabulary 8192, sequence 128: the benchmark LM."""
        return cls(vocab_size=8192, d_model=512, n_heads=8, n_layers=8, seq_len=128)

    @classmethod
    def demo(cls) -> LMConfig:
        """Small enough to train to its loss floor in a couple of minutes on two CPU cores."""
        return cls(vocab_size=64, d_model=128, n_heads=4, n_layers=2, seq_len=32)

    @classmethod
    def quick(cls) -> LMConfig:
        """The benchmarks' ``--quick`` LM: two blocks of width 32, so a run of any suite takes seconds."""
        return cls(vocab_size=64, d_model=32, n_heads=4, n_layers=2, seq_len=16)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then an MLP, each with a residual."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(attn.transpose(1, 2).reshape(b, t, d)))
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class TransformerLM(nn.Module):
    """A GPT-style language model whose output projection shares the input embedding's weight.

    ``forward(tokens)`` returns logits of shape (batch, seq, vocab); :meth:`loss` the mean next-token
    cross-entropy.
    """

    def __init__(self, cfg: Optional[LMConfig] = None, wrap_fn: ModuleFn = _identity) -> None:
        super().__init__()
        cfg = cfg or LMConfig()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.d_model))
        self.blocks = nn.ModuleList([wrap_fn(Block(cfg)) for _ in range(cfg.n_layers)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.embed.weight
        self._init_weights()

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        nn.init.normal_(self.pos, std=0.01)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self(tokens), targets)


def lm_batch(cfg: LMConfig, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and their next-token targets, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=gen)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


class NestedWrappedModule(nn.Module):
    """Linear layers nested three levels deep; ``wrap_fn`` is applied to the nested groups as they are built.

    Input: (batch, 8) floats. Output: (batch, 8).
    """

    def __init__(self, wrap_fn: ModuleFn = _identity) -> None:
        super().__init__()
        self.module = nn.Sequential(
            nn.Linear(8, 4),
            wrap_fn(
                nn.Sequential(
                    wrap_fn(nn.Linear(4, 16)),
                    nn.ReLU(),
                    nn.Linear(16, 16),
                )
            ),
            wrap_fn(nn.Linear(16, 4)),
            nn.Tanh(),
            nn.Linear(4, 8),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


class BatchNormNet(nn.Module):
    """Linear → BatchNorm1d → ReLU → Linear: running statistics are buffers updated by forward.

    Input: (batch, 8) floats. Output: (batch, 4).
    """

    def __init__(self, wrap_fn: ModuleFn = _identity) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.body = wrap_fn(nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU()))
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.body(F.relu(self.bn(self.fc1(x)))))


class MixtureOfExperts(nn.Module):
    """Shared layers around one expert whose parameters differ per rank.

    The expert is initialised from ``expert_seed`` (pass the rank) so no two ranks hold the same expert; it
    must never be averaged across ranks. :meth:`expert_parameters` names its parameters so strategies can
    shard or reduce it in its own (for example size-one) process group. Input: (batch, 8). Output: (batch, 8).
    """

    def __init__(self, expert_seed: int = 0, wrap_fn: ModuleFn = _identity, expert_wrap_fn: ModuleFn = _identity):
        super().__init__()
        self.encoder = nn.Linear(8, 16)
        with torch.random.fork_rng():
            torch.manual_seed(10_000 + expert_seed)
            expert = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.expert = expert_wrap_fn(expert)
        self.decoder = wrap_fn(nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.expert(torch.relu(self.encoder(x))) + 1.0)

    def expert_parameters(self) -> list[nn.Parameter]:
        return list(self.expert.parameters())

    def expert_parameter_names(self) -> list[str]:
        return [f"expert.{name}" for name, _ in self.expert.named_parameters()]


def dense_batch(
    in_features: int, batch_size: int, seed: int, out_features: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian inputs and regression targets, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, in_features, generator=gen)
    y = torch.randn(batch_size, out_features or in_features, generator=gen)
    return x, y


def build(name: str, seed: int = 0, **kwargs: Any) -> nn.Module:
    """Build a reference model by name with a fixed seed: ``lm``, ``nested``, ``batchnorm`` or ``moe``."""
    torch.manual_seed(seed)
    builders: dict[str, Callable[..., nn.Module]] = {
        "lm": TransformerLM,
        "nested": NestedWrappedModule,
        "batchnorm": BatchNormNet,
        "moe": MixtureOfExperts,
    }
    if name not in builders:
        raise ValueError(f"unknown reference model {name!r}; choose one of {sorted(builders)}")
    return builders[name](**kwargs)


def make_batch(name: str, model: nn.Module, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch for reference model ``name``; ``seed`` should differ per rank and step."""
    if name == "lm":
        assert isinstance(model, TransformerLM)
        return lm_batch(model.cfg, batch_size, seed)
    out = {"nested": 8, "batchnorm": 4, "moe": 8}[name]
    return dense_batch(8, batch_size, seed, out)


def loss_for(name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The training loss of reference model ``name``: cross-entropy for the LM, MSE otherwise."""
    if name == "lm":
        return TransformerLM.loss_fn(output, target)
    # Promoted by hand: torch 2.8's mse_loss backward refuses a bfloat16 output against a float32 target.
    dtype = torch.promote_types(output.dtype, target.dtype)
    return F.mse_loss(output.to(dtype), target.to(dtype))


def param_count(module: nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once)."""
    return sum(p.numel() for p in module.parameters())


def lm_flops_per_token(cfg: LMConfig) -> float:
    """Rough forward FLOPs per token, used for cost estimates: 2 x parameters + attention."""
    per_block = 12 * cfg.d_model**2
    return 2 * (cfg.n_layers * per_block + cfg.vocab_size * cfg.d_model) + 2 * cfg.n_layers * cfg.seq_len * cfg.d_model


__all__ = [
    "BatchNormNet",
    "Block",
    "LMConfig",
    "MixtureOfExperts",
    "NestedWrappedModule",
    "TransformerLM",
    "build",
    "dense_batch",
    "lm_batch",
    "loss_for",
    "make_batch",
    "param_count",
]
