"""Shared pieces of the smp tests: small models, a reference trainer, and one pipelined training run."""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import shardkit.modelparallel as smp
from shardkit.testing.models import LMConfig, TransformerLM, lm_batch
from testkit import max_state_diff, regression_batch
from testkit.smp import microbatch_reference


def mlp() -> nn.Module:
    """Seven modules in a row: enough to give each of four stages something; in-place ReLUs."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.ReLU(inplace=True),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.ReLU(inplace=True),  # at the start of a stage with four: updates a received activation in place
        nn.Linear(16, 4),
    )


class PairBlock(nn.Module):
    """Returns a tuple; its second output skips the next module."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(16, 16)
        self.right = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.left(h)), self.right(h)


class ResidualNet(nn.Module):
    """Not a Sequential: residuals that cross stages, tuple and dict outputs, a parameter used in glue code,
    an in-place update of a module output that other stages also use.

    With ``stages`` set, modules are placed with ``smp.partition`` (embed, pair, mix, head on stages
    0, 1, 2, 3 for four stages; 0, 0, 1, 1 for two).
    """

    def __init__(self, stages: int = 0) -> None:
        super().__init__()
        torch.manual_seed(1)
        where = [0, 1, 2, 3] if stages == 4 else [0, 0, 1, 1]
        with smp.partition(where[0]) if stages else contextlib.nullcontext():
            self.embed = nn.Linear(8, 16)
        with smp.partition(where[1]) if stages else contextlib.nullcontext():
            self.pair = PairBlock()
        with smp.partition(where[2]) if stages else contextlib.nullcontext():
            self.mix = nn.Linear(16, 16)
        with smp.partition(where[3]) if stages else contextlib.nullcontext():
            self.head = nn.Linear(16, 4)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        e = self.embed(x)
        h = torch.relu(e)
        e.mul_(0.5)  # in place after e was sent on: the gradient coming back must skip this
        a, b = self.pair(h)
        z = self.mix(a * self.scale) + h  # h comes from the first stage
        out = self.head(z + b + e)
        return out, {"aux": (a * a).mean(dim=1)}


def tiny_lm() -> nn.Module:
    """The default LMConfig's TransformerLM, seeded."""
    torch.manual_seed(2)
    return TransformerLM(LMConfig())


def loss_of(name: str, out: Any, y: torch.Tensor) -> torch.Tensor:
    """Model ``name``'s training loss (the residual net adds its auxiliary output)."""
    if name == "residual":
        pred, extra = out
        return F.mse_loss(pred, y) + 0.1 * extra["aux"].mean()
    if name.startswith("lm"):  # "lm" and variants of it other tests register
        return TransformerLM.loss_fn(out, y)
    return F.mse_loss(out, y)


def batch(name: str, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` rows for model ``name``: token ids for the LM, else 8 features in and 4 out."""
    if name.startswith("lm"):  # "lm" and variants of it other tests register
        return lm_batch(LMConfig(), size, seed)
    return regression_batch(seed, rows=size, inputs=8, outputs=4)


BUILDERS: dict[str, Callable[..., nn.Module]] = {"mlp": mlp, "residual": ResidualNet, "lm": tiny_lm}


@smp.step
def train_step(model: smp.DistributedModel, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = loss_of(name, model(x), y)
    model.backward(loss)
    return loss


def train_steps(model: smp.DistributedModel, opt: Any, name: str, batch_size: int, steps: range) -> list[float]:
    """One optimizer step of :func:`train_step` per step in ``steps`` on ``batch(name, batch_size, step)`` (the same
    batch on every replica); each step's loss averaged over the micro-batches."""
    losses = []
    for s in steps:
        x, y = batch(name, batch_size, s)
        opt.zero_grad()
        losses.append(train_step(model, name, x, y).reduce_mean().item())
        opt.step()
    return losses


def reference_run(
    name: str, steps: int, batch_size: int, replicas: int = 1, accumulate: int = 1, lr: float = 0.05
) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Single-process training on the global batch (stepping every ``accumulate`` batches); returns per-step
    per-replica losses and the final weights."""
    model = BUILDERS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for s in range(steps):
        parts = [batch(name, batch_size, 100 * s + d) for d in range(replicas)]
        per_replica = [loss_of(name, model(x), y) for x, y in parts]
        if s % accumulate == 0:
            opt.zero_grad()
        (sum(per_replica) / replicas).backward()
        if (s + 1) % accumulate == 0:
            opt.step()
        losses.append([loss.item() for loss in per_replica])
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def smp_run(
    name: str,
    config: dict[str, Any],
    steps: int,
    batch_size: int,
    model_kwargs: Optional[dict[str, Any]] = None,
    lr: float = 0.05,
    **model_options: Any,
) -> tuple[list[float], dict[str, torch.Tensor], smp.DistributedModel]:
    """Train with smp under ``config``; returns this replica's losses, the full final state dict, the model.

    With ``backward_passes_per_step=k`` among ``model_options`` the optimizer steps every ``k`` steps.
    """
    smp.init(config)
    model = smp.DistributedModel(BUILDERS[name](**(model_kwargs or {})), **model_options)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    accumulate = model_options.get("backward_passes_per_step", 1)
    losses = []
    for s in range(steps):
        x, y = batch(name, batch_size, 100 * s + smp.dp_rank())
        if s % accumulate == 0:
            opt.zero_grad()
        losses.append(train_step(model, name, x, y).reduce_mean().item())
        if (s + 1) % accumulate == 0:
            opt.step()
    return losses, model.state_dict(), model


# ---- parity against one process ----

#: The parity runs: their tolerance against one process, steps and batch.
PARITY_TOL = 1e-5
PARITY_STEPS = 3
PARITY_BATCH = 8


ParityCase = tuple[str, dict[str, Any], dict[str, Any]]


def parity_results(
    rank: int, world_size: int, cases: list[ParityCase], options: Optional[dict[str, Any]] = None
) -> dict[str, Any]:
    """Each case of ``cases`` (builder name, smp config, model options) trained pipelined and in one process:
    the largest loss and parameter differences, how far training moved, parameters held here and in all."""
    results = {}
    options = options or {}
    steps = PARITY_STEPS * options.get("backward_passes_per_step", 1)
    for name, config, model_kwargs in cases:
        replicas = world_size // config["partitions"]
        ref_losses, ref_state = reference_run(
            name, steps, PARITY_BATCH, replicas, options.get("backward_passes_per_step", 1)
        )
        losses, state, model = smp_run(name, config, steps, PARITY_BATCH, model_kwargs, **options)
        key = f"{name}-{config}-{options}"
        results[key] = {
            "loss_diff": max(abs(a - b[smp.dp_rank()]) for a, b in zip(losses, ref_losses)),
            "param_diff": max_state_diff(state, ref_state),
            "trained": max_state_diff(ref_state, reference_run(name, 0, PARITY_BATCH)[1]),
            "local": sum(p.numel() for p in model.local_parameters()),
            "total": sum(v.numel() for v in ref_state.values()),
        }
        smp.reset()
    return results


def check_parity(results: list[dict[str, Any]], split: bool = True) -> None:
    """Every case on every rank within :data:`PARITY_TOL` of one process, trained, and (``split``) split."""
    for per_rank in results:
        for key, r in per_rank.items():
            assert r["loss_diff"] <= PARITY_TOL, (
                f"{key}: losses differ from single-process training by {r['loss_diff']}"
            )
            assert r["param_diff"] <= PARITY_TOL, (
                f"{key}: parameters differ from single-process training by {r['param_diff']}"
            )
            assert r["trained"] > 1e-3, f"{key}: training did not change the reference parameters"
            if split:
                assert r["local"] < r["total"], f"{key}: a stage holds every parameter, nothing was split"


# ---- the activation-checkpointing tests' net ----

#: The activation-checkpointing net's runs: micro-batches and steps.
CKPT_MICROBATCHES = 2
CKPT_STEPS = 3


class CkptBlock(nn.Module):
    """``tanh(linear(x)) + x``: a residual block worth checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + x


class CkptNet(nn.Module):
    """``pre`` (a Sequential) and blocks 0-1 on stage 0, blocks 2-3 and the head on stage 1 when ``manual``."""

    def __init__(self, manual: bool) -> None:
        super().__init__()
        torch.manual_seed(5)
        with smp.partition(0) if manual else contextlib.nullcontext():
            self.pre = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
            first = [CkptBlock(), CkptBlock()]
        with smp.partition(1) if manual else contextlib.nullcontext():
            last = [CkptBlock(), CkptBlock()]
            self.head = nn.Linear(16, 4)
        self.blocks = nn.Sequential(*first, *last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.pre(x)))


#: Each step's batch: 8 rows of 8 features in, 4 out.
ckpt_batch = functools.partial(regression_batch, inputs=8, outputs=4)


def ckpt_reference() -> list[float]:
    """Every micro-batch's loss of :class:`CkptNet` trained in one process as smp trains it."""
    torch.manual_seed(0)
    model = CkptNet(manual=False)
    return microbatch_reference(
        model, torch.optim.SGD(model.parameters(), lr=0.1), CKPT_STEPS, ckpt_batch, CKPT_MICROBATCHES
    )


# ---- checkpoint round trips ----

#: The checkpoint round trips' default smp config.
CHECKPOINT_CONFIG: dict[str, Any] = {"partitions": 2, "microbatches": 2}


@smp.step
def predict(model: smp.DistributedModel, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def _checkpoint_build(seed: int, config: dict[str, Any]) -> tuple[smp.DistributedModel, smp.DistributedOptimizer]:
    smp.init(config)
    torch.manual_seed(seed)
    model = smp.DistributedModel(TransformerLM(LMConfig()))
    return model, smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def _checkpoint_train(model: smp.DistributedModel, opt: Any, steps: range) -> list[float]:
    return train_steps(model, opt, "lm", 4, steps)


def checkpoint_round_trips(
    rank: int, world_size: int, directory: str, config: Optional[dict[str, Any]] = None
) -> dict[str, Any]:
    """Train an LM, save partial and full checkpoints, train on; then each checkpoint loaded into a fresh job
    (and the full one into the plain model) must continue identically. Returns the differences found."""
    config = config if config is not None else CHECKPOINT_CONFIG
    partial_path, full_path = os.path.join(directory, "partial.pt"), os.path.join(directory, "full.pt")
    model, opt = _checkpoint_build(2, config)
    _checkpoint_train(model, opt, range(2))
    if smp.dp_rank() == 0:
        smp.save({"model": model.local_state_dict(), "opt": opt.local_state_dict()}, partial_path, partial=True)
        smp.save({"model": model.state_dict(), "opt": opt.state_dict()}, full_path, partial=False)
    smp.barrier()
    continued = _checkpoint_train(model, opt, range(2, 4))
    final = model.state_dict()
    x, _ = batch("lm", 4, 99)
    final_out = predict(model, x).concat()
    x8, _ = batch("lm", 8, 98)
    final_out8 = predict(model, x8).concat()  # new micro-batch shape: the stages discover its shapes
    held = sum(v.numel() for k, v in model.local_state_dict().items() if k != "_smp_is_partial")
    smp.reset()

    results: dict[str, Any] = {"files": sorted(os.listdir(directory)), "held": held}
    for kind, path, partial in (("partial", partial_path, True), ("full", full_path, False)):
        model, opt = _checkpoint_build(7, config)  # different weights: only the checkpoint can make it match
        checkpoint = smp.load(path, partial=partial)
        model.load_state_dict(checkpoint["model"])  # before the partition: applied when it happens
        opt.load_state_dict(checkpoint["opt"])
        results[f"{kind}_loss_diff"] = max(
            abs(a - b) for a, b in zip(_checkpoint_train(model, opt, range(2, 4)), continued)
        )
        results[f"{kind}_param_diff"] = max_state_diff(model.state_dict(), final)
        results[f"{kind}_out_diff"] = (predict(model, x).concat() - final_out).abs().max().item()
        smp.reset()

    # The full checkpoint is a plain torch checkpoint: the unwrapped model and optimizer load it as is.
    plain = tiny_lm()
    checkpoint = torch.load(full_path)
    plain.load_state_dict(checkpoint["model"])
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    plain_opt.load_state_dict(checkpoint["opt"])
    plain_losses = []
    for s in range(2, 4):
        xs, ys = batch("lm", 4, s)
        plain_opt.zero_grad()
        loss = loss_of("lm", plain(xs), ys)
        loss.backward()
        plain_opt.step()
        plain_losses.append(loss.item())
    results["plain_loss_diff"] = max(abs(a - b) for a, b in zip(plain_losses, continued))
    results["plain_out_diff"] = max(
        (plain(x) - final_out).abs().max().item(), (plain(x8) - final_out8).abs().max().item()
    )
    results["total"] = sum(v.numel() for v in plain.state_dict().values())
    return results


def peak_held(actions: Any) -> int:
    """The most micro-batches (chunk-micro-batches under virtual stages) a schedule's ``actions`` hold from F to W
    at once: what its activation memory peaks at."""
    held = peak = 0
    for action in actions:
        held += {"F": 1, "B": 0, "W": -1}[action.kind]
        peak = max(peak, held)
    return peak


#: The smp config AWS's GPT-2 example scripts pass (train_gpt_simple.py / train.py), at a run without tensor
#: parallelism or sharded data parallelism.
AWS_GPT2_CONFIG: dict[str, Any] = {
    "ddp": True,
    "tensor_parallel_degree": 1,
    "pipeline_parallel_degree": 1,
    "microbatches": 2,
    "shard_optimizer_state": False,
    "prescaled_batch": False,
    "fp16": False,
    "bf16": False,
    "offload_activations": False,
    "delayed_parameter_initialization": True,
    "optimize": "speed",
    "placement_strategy": "cluster",
    "activation_loading_horizon": 4,
    "skip_tracing": False,
    "auto_partition": True,
    "default_partition": 0,
    "static_mode": False,
    "fast_mode": False,
    "sharded_data_parallel_degree": 1,
}


def tiny_gpt2_config(positions: int = 16) -> Any:
    """A Hugging Face ``GPT2Config`` of 2 layers, width 32, 64 tokens and no dropout (needs transformers)."""
    import transformers

    return transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=positions,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )


def split_linears_run(
    optimizer_cls: type[torch.optim.Optimizer], lr: float, shard_by_rdp: bool, steps: int = 3
) -> dict[str, list[Any]]:
    """Train three ``nn.Linear``s made distributed by ``smp.tensor_parallelism()`` beside plain torch on the whole
    batch, under the config ``smp.init`` was given (call it between ``smp.init`` and ``smp.reset``).

    Each rank takes its share of the batch by ``rdp_rank`` (``prescaled_batch``) or ``dp_rank``. Returns per step
    ``losses``, the data-parallel group's step losses (their mean is smp's loss), and ``theirs``, plain torch's
    (the mean of the micro-batches' mean losses over the whole batch).
    """
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(optimizer_cls(model.parameters(), lr=lr))  # type: ignore[call-arg]
    plain = optimizer_cls(reference.parameters(), lr=lr)  # type: ignore[call-arg]

    losses, theirs = [], []
    rank, size = (smp.rdp_rank(), smp.rdp_size()) if shard_by_rdp else (smp.dp_rank(), smp.dp_size())
    parts = size * smp.state.current().config.microbatches
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)
        optimizer.zero_grad()
        losses.append(
            smp.allgather(
                train_step(model, "mlp", x.chunk(size)[rank], y.chunk(size)[rank]).reduce_mean().item(), smp.DP_GROUP
            )
        )
        optimizer.step()
        plain.zero_grad()
        ref_loss = sum(F.mse_loss(reference(a), b) for a, b in zip(x.chunk(parts), y.chunk(parts))) / parts
        ref_loss.backward()
        plain.step()
        theirs.append(ref_loss.item())
    return {"losses": losses, "theirs": theirs}
