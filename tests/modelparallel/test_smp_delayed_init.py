"""``smp.delay_param_initialization``: a model bigger than one process may hold trains once partitioned.

Each process runs under a tracked cap on the tensor memory it allocates (a dispatch mode counting live CPU
storages): the whole model's parameters exceed the cap, so building it normally fails, while with delayed
initialisation over 4 stages each process only ever creates its stage's share. The losses equal single-process
training of the same model, initialised as delayed initialisation documents (each module reset under a seed from
the job's seed and its name).
"""

from __future__ import annotations

import functools
import weakref
import zlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed
from testkit import regression_batch
from testkit.smp import microbatch_reference, mse_step

SEED = 1234
WIDTH = 256
LAYERS = 8
MICROBATCHES = 2
STEPS = 2


class TensorMemoryCap(TorchDispatchMode):
    """Raise ``MemoryError`` when the CPU tensors allocated under this mode and still alive exceed ``cap`` bytes."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap, self.live, self.peak = cap, 0, 0
        self._storages: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._count(t.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        if key in self._storages or storage.nbytes() == 0:
            return
        self._storages.add(key)
        self.live += storage.nbytes()
        weakref.finalize(storage, self._free, key, storage.nbytes())
        self.peak = max(self.peak, self.live)
        if self.live > self.cap:
            raise MemoryError(f"tensor memory cap exceeded: {self.live} bytes live > cap {self.cap}")

    def _free(self, key: int, nbytes: int) -> None:
        self._storages.discard(key)
        self.live -= nbytes


def _net() -> nn.Module:
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)], nn.Linear(WIDTH, 4))


def _full_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in _net().parameters())


#: Each step's batch: 8 rows of WIDTH features in, 4 out.
_batch = functools.partial(regression_batch, inputs=WIDTH, outputs=4)


def _reference() -> list[float]:
    """Single process: the model built normally, each module reset as delayed initialisation documents."""
    model = _net()
    for name, module in model.named_modules():
        if hasattr(module, "reset_parameters"):
            torch.manual_seed((SEED + zlib.crc32(name.encode())) % (2**63))
            module.reset_parameters()
    return microbatch_reference(model, torch.optim.SGD(model.parameters(), lr=0.05), STEPS, _batch, MICROBATCHES)


def _capped(rank: int, world_size: int, cap: int) -> dict[str, Any]:
    torch.manual_seed(SEED)
    smp.init({"partitions": world_size, "microbatches": MICROBATCHES})
    out: dict[str, Any] = {}
    with TensorMemoryCap(cap) as meter:
        try:
            _net()
            out["plain_build"] = "built"
        except MemoryError as exc:
            out["plain_build"] = str(exc)
    with TensorMemoryCap(cap) as meter:
        with smp.delay_param_initialization():
            net = _net()
        model = smp.DistributedModel(net)
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
        losses = []
        for s in range(STEPS):
            x, y = _batch(s)
            opt.zero_grad()
            losses.extend(t.item() for t in mse_step(model, x, y).outputs)
            opt.step()
    out["losses"] = losses
    out["peak"] = meter.peak
    out["held"] = sum(p.numel() * p.element_size() for p in model.local_parameters())
    smp.reset()
    return out


def test_model_bigger_than_the_cap_trains_when_partitioned_with_delayed_init() -> None:
    full = _full_bytes()
    cap = int(0.75 * full)  # the whole model's parameters do not fit; a quarter of them plus gradients does
    reference = _reference()
    for rank, r in enumerate(run_distributed(_capped, 4, cap)):
        assert "cap exceeded" in r["plain_build"], (rank, r["plain_build"])
        assert r["peak"] <= cap and r["held"] < full / 2, (rank, r["peak"], r["held"], full)
        diff = max(abs(a - b) for a, b in zip(r["losses"], reference))
        assert len(r["losses"]) == len(reference) and diff <= 1e-5, (rank, diff)


class _TiedLM(nn.Module):
    """An embedding and an output layer sharing one weight: the two stages hold a copy each."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.mix = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.embed(tokens)))


def _tokens(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 * step + replica)
    return torch.randint(0, 32, (8,), generator=gen), torch.randint(0, 32, (8,), generator=gen)


@smp.step
def _lm_step(model: smp.DistributedModel, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(tokens), targets)
    model.backward(loss)
    return loss


def _tied_reference(replicas: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    model = _TiedLM()
    for name, module in model.named_modules():  # delayed initialisation's documented values
        if hasattr(module, "reset_parameters"):
            torch.manual_seed((SEED + zlib.crc32(name.encode())) % (2**63))
            module.reset_parameters()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        per_replica = []
        for replica in range(replicas):
            x, y = _tokens(s, replica)
            mb = [F.cross_entropy(model(xm), ym) for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))]
            per_replica.append(mb)
        (sum(sum(mb) / MICROBATCHES for mb in per_replica) / replicas).backward()
        opt.step()
        losses.append([loss.item() for mb in per_replica for loss in mb])
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _tied_delayed(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(SEED)
    smp.init({"partitions": 2, "microbatches": MICROBATCHES, "ddp": True})
    with smp.delay_param_initialization():
        net = _TiedLM()
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        losses.append([t.item() for t in _lm_step(model, *_tokens(s, smp.dp_rank())).outputs])
        opt.step()
    out = {"losses": losses, "dp_rank": smp.dp_rank(), "state": model.state_dict()}
    smp.reset()
    return out


def test_tied_weights_and_replicas_get_the_same_values_as_one_process() -> None:
    """2 stages x 2 replicas: the tied copies on both stages and both replicas start equal and train as one."""
    reference, final = _tied_reference(replicas=2)
    for rank, r in enumerate(run_distributed(_tied_delayed, 4)):
        replica = r["dp_rank"]
        for s in range(STEPS):
            want = reference[s][replica * MICROBATCHES : (replica + 1) * MICROBATCHES]
            assert max(abs(a - b) for a, b in zip(r["losses"][s], want)) <= 1e-5, (rank, s, r["losses"][s], want)
        assert max((r["state"][k] - final[k]).abs().max().item() for k in final) <= 1e-5, rank


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def _refused(rank: int, world_size: int) -> str:
    smp.init({"partitions": world_size, "microbatches": 1})
    with smp.delay_param_initialization():
        net = nn.Sequential(nn.Linear(4, 4), _NoReset())
    model = smp.DistributedModel(net)
    try:
        mse_step(model, torch.randn(2, 4), torch.randn(2, 4))
    except Exception as exc:  # the test asserts the message
        return f"{type(exc).__name__}: {exc}"
    finally:
        smp.reset()
    return "no error"


def test_module_without_reset_parameters_is_refused_on_every_rank() -> None:
    for message in run_distributed(_refused, 2):
        assert "reset_parameters" in message and "_NoReset" in message, message


def _mixed(rank: int, world_size: int) -> str:
    smp.init({"partitions": world_size, "microbatches": 1})
    with smp.delay_param_initialization(enabled=rank == 0):
        net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model = smp.DistributedModel(net)
    try:
        mse_step(model, torch.ones(2, 4), torch.zeros(2, 4))
    except Exception as exc:  # the test asserts the message
        return f"{type(exc).__name__}: {exc}"
    finally:
        smp.reset()
    return "no error"


def test_delayed_on_some_ranks_only_is_refused_on_every_rank() -> None:
    for message in run_distributed(_mixed, 2):
        assert message.startswith("ValueError") and "ranks [0]" in message, message


def test_disabled_context_builds_normally() -> None:
    with smp.delay_param_initialization(enabled=False):
        assert not nn.Linear(2, 2).weight.is_meta
    with smp.delayed_parameter_initialization():
        assert nn.Linear(2, 2).weight.is_meta
    with pytest.raises(ValueError, match="part of the model"):
        with smp.delay_param_initialization():
            meta = nn.Linear(2, 2)
        from shardkit.modelparallel.building.delayed_init import check_delayable

        check_delayable(nn.Sequential(meta, nn.Linear(2, 2)))
