"""``shardkit bench plan``: how exact ``shardkit plan`` is, and how fast.

1. **Accuracy.** For the bench LM, the demo LM and a transformers GPT-2 config at world sizes 2 and 4, every
   strategy (smp: 2 partitions, 2 micro-batches per replica of the same batch; FSDP also with CPU offload, where the
   planned device and host memory together are compared, the CPU run having one memory) is planned for rank 0 (for
   smp, the stage with the highest peak) on the meta device with a peerless group, then trained for real on gloo
   processes: planned peak against torch's ``MemTracker``, planned state against the real tensors, planned bytes
   sent against shardkit's comm meter (see :mod:`shardkit.plan.accuracy` for the conventions).
2. **Speed.** ``shardkit plan`` of a 7B Llama-style config (hidden 4096, 32 layers, intermediate 11008,
   vocabulary 32000, sequence 2048, one sequence per rank) at world size 64, every setting, in a child process:
   wall time and peak resident memory.

Options: ``--quick`` (small configs, world size 2, no 7B run; seconds), ``--world-size N`` (only that size),
``--skip-7b``.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from dataclasses import replace

from shardkit.plan.accuracy import HEADER, compare
from shardkit.plan.workloads import Workload

STRATEGIES = ["ddp", "oss_ddp", "oss_sdp", "fsdp", "slowmo"]
#: smp's settings in the accuracy table.
PIPELINE_OPTIONS = {"partitions": 2, "microbatches": 2}
#: FSDP with CPU offload in the accuracy table (planned device + host memory against the CPU run's one memory).
OFFLOAD_OPTIONS = {"cpu_offload": True}
LLAMA_7B = "hidden_size=4096,num_hidden_layers=32,intermediate_size=11008,vocab_size=32000,num_attention_heads=32"


def _workloads(quick: bool) -> list[tuple[str, Workload]]:
    if quick:
        return [("demo LM", Workload.demo_lm(batch_size=4))]
    return [
        ("bench LM", Workload.bench_lm(batch_size=2)),
        ("demo LM", Workload.demo_lm(batch_size=8)),
        (
            "GPT-2 (6 layers, 384 wide)",
            Workload.hf("gpt2", {"n_layer": 6, "n_embd": 384, "n_head": 6, "n_positions": 256}, batch_size=2),
        ),
    ]


def plan_7b_seconds() -> tuple[float, int, str]:
    """Wall seconds and peak RSS (bytes) of ``shardkit plan`` for the 7B config at world size 64, and its output."""
    cmd = [sys.executable, "-m", "shardkit.cli", "plan", "--hf", "llama", LLAMA_7B, "--batch-size", "1",
           "--seq-len", "2048", "--world-sizes", "64"]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return seconds, rss_kib * 1024, done.stdout


def run(argv: list[str]) -> None:
    """Print the accuracy table and the 7B planning time (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="shardkit bench plan", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small configs, world size 2, no 7B run")
    parser.add_argument("--world-size", type=int, default=None, help="only this world size")
    parser.add_argument("--skip-7b", action="store_true", help="leave out the 7B planning run")
    parser.add_argument("--steps", type=int, default=None, help="ignored (the plan runs a fixed step count)")
    parser.add_argument("--warmup", type=int, default=None, help="ignored")
    args = parser.parse_args(argv)
    sizes = [args.world_size] if args.world_size else ([2] if args.quick else [2, 4])
    print(HEADER, flush=True)
    worst_peak = worst_state = 0.0
    unequal = 0
    for label, work in _workloads(args.quick):
        for world_size in sizes:
            pipeline = replace(work, strategy_options=PIPELINE_OPTIONS)
            offload = replace(work, strategy_options=OFFLOAD_OPTIONS)
            rows = [
                *compare(work, STRATEGIES, world_size, label),
                *compare(pipeline, ["smp"], world_size, label),
                *(replace(row, strategy="fsdp + cpu offload") for row in compare(offload, ["fsdp"], world_size, label)),
            ]
            for row in rows:
                print(row.format(), flush=True)
                worst_peak = max(worst_peak, abs(row.peak_error))
                worst_state = max(worst_state, abs(row.state_error))
                unequal += row.planned_comm != row.real_comm
    print(
        f"\nlargest peak error {worst_peak:.1%}, largest state error {worst_state:.1%}, "
        f"rows whose bytes sent differ: {unequal}"
    )
    if args.quick or args.skip_7b:
        return
    seconds, rss, output = plan_7b_seconds()
    print(f"\n7B Llama-style config, world size 64, every setting: {seconds:.1f} s, peak RSS {rss / 2**20:.0f} MiB")
    print(output)
