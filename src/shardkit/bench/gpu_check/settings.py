"""What one gpu-check run is: its parts and their time limits, whether this machine is meant to have a GPU, and
which form the two-rank checks take (two GPUs over NCCL, or two ranks sharing one device over gloo).

No torch here: the runner decides everything before any part imports it.
"""

from __future__ import annotations

import glob
import os
import shutil
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Part:
    """One part: run in its own process group, killed at ``limit_s`` (seconds, on one H200)."""

    name: str
    limit_s: int
    what: str


#: Run in this order, most valuable first. The limits come from the CPU ``--small`` run's part times (BENCHMARKS.md's
#: gpu-check note) plus the GPU work each part adds at full size; they add up to 470 s, more than
#: :data:`BUDGET_S`, so a slow run squeezes the last parts (each gets what is left), never the first.
PARTS: tuple[Part, ...] = (
    Part("env", 25, "versions, the GPU, its measured bf16 matmul rate, every module imported, private torch APIs"),
    Part("strategies", 45, "every strategy, smp and SlowMo (its slow step) at world size 1 against the plain model"),
    Part("amp", 30, "fp16 + loss scaler with an injected inf: FSDP, OSS+SDP, smp amp skip the step and halve"),
    Part("fsdp", 45, "FSDP on side streams (bitwise against stream-less), lagging streams, offload, bf16"),
    Part("checkpoint", 35, "async sharded checkpoint with AdamW state changed in place after the save returns"),
    Part("ranks2", 50, "two ranks: strategies, amp with an inf on one rank, checkpoint (NCCL on two GPUs)"),
    Part("pipeline", 45, "every smp schedule over two ranks (NCCL batch_isend_irecv on two GPUs), bubble vs theory"),
    Part("throughput", 70, "~1B model built on the GPU: shardkit FSDP vs torch FSDP2 interleaved, MFU"),
    Part("plan", 45, "shardkit plan's device peak against the allocator's, ~1B model, DDP and FSDP"),
    Part("compile", 50, "torch.compile (inductor) of shardkit FSDP against eager"),
    Part("cuda_tests", 30, "the suite's three CUDA-only tests under pytest (not run when pytest is missing)"),
)
#: Hidden parts, run only when named in ``--parts``: the plumbing's own test (a part that hangs).
SELFTEST_PARTS: tuple[Part, ...] = (Part("selftest_hang", 8, "records one check, then hangs until killed"),)
#: Wall seconds for all parts together, process starts included: 6 min 40 s, under the 7 minutes a lent
#: machine's 15 (its start included) leave for a rerun of the failing parts.
BUDGET_S = 400
#: A part is not started with less than this left in the budget.
MIN_PART_S = 8


def part_named(name: str) -> Part:
    """The part called ``name`` (hidden ones included); a clear error naming the choices otherwise."""
    for part in PARTS + SELFTEST_PARTS:
        if part.name == name:
            return part
    raise ValueError(f"unknown gpu-check part {name!r}; choose from {', '.join(p.name for p in PARTS)}")


def inner_timeout_s(limit_s: float) -> float:
    """Seconds a part's own watchdogs allow (stack dumps, rank timeouts): inside its limit, so a hang is
    reported by the part before the runner kills it."""
    return max(1.0, limit_s - max(2.0, 0.1 * limit_s))


def gpu_evidence() -> dict[str, bool]:
    """Signs, besides torch, that this machine has an NVIDIA GPU."""
    return {"dev_nvidia": bool(glob.glob("/dev/nvidia[0-9]*")), "nvidia_smi": shutil.which("nvidia-smi") is not None}


def expect_gpu(flag: Optional[bool], small: bool, dry_run: bool) -> tuple[bool, str]:
    """Whether this run must find CUDA, and why: ``--expect-gpu``/``--no-expect-gpu`` when given; else yes
    unless ``--small`` or ``--dry-run``; and yes whenever the machine shows an NVIDIA device."""
    if flag is not None:
        return flag, "--expect-gpu" if flag else "--no-expect-gpu"
    if not (small or dry_run):
        return True, "neither --small nor --dry-run was given (the lent GPU machine's form)"
    evidence = [k for k, v in gpu_evidence().items() if v]
    if evidence:
        return True, f"this machine shows an NVIDIA GPU ({', '.join(evidence)})"
    return False, "--small/--dry-run on a machine with no /dev/nvidia* and no nvidia-smi"


@dataclass(frozen=True)
class RankForm:
    """How the two-rank parts run here."""

    backend: str
    multi_gpu: bool
    label: str


#: Tests set this to pretend a number of GPUs (on CPU the ranks still talk gloo): the multi-GPU plumbing runs.
FAKE_GPUS_ENV = "SHARDKIT_GPU_CHECK_FAKE_GPUS"


def rank_form(cuda: bool, device_count: int) -> RankForm:
    """Two GPUs or more: one rank per GPU over NCCL, each rank's device chosen by shardkit (``LOCAL_RANK``).
    One GPU: both ranks on it over gloo (NCCL refuses two ranks on one device). No CUDA: gloo on CPU."""
    fake = os.environ.get(FAKE_GPUS_ENV)
    count = int(fake) if fake else device_count
    if count >= 2:
        if cuda:
            return RankForm("nccl", True, f"multi-GPU: two ranks on two of {count} GPUs over NCCL")
        return RankForm("gloo", True, f"multi-GPU form faked on CPU ({count} pretend GPUs), gloo")
    if cuda:
        return RankForm("gloo", False, "one GPU: two ranks share it over gloo; NCCL between ranks not run")
    return RankForm("gloo", False, "no GPU: two ranks on CPU over gloo")


ONE_GPU_WHY = "needs two GPUs (torch.cuda.device_count() >= 2); this machine has fewer"
