"""``shardkit bench plan``: how exact ``shardkit plan`` is, and how fast.

1. **Accuracy.** For the bench LM, the demo LM and a transformers GPT-2 config at world sizes 2 and 4, and for
   Hugging Face families shardkit does not ship (BERT masked LM, T5, Llama with grouped-query attention, ViT image
   classifier: small configs, transformers' default SDPA attention) at world size 2, every strategy (smp: 2
   partitions, 2 micro-batches per replica of the same batch; FSDP also with CPU offload, where the planned device
   and host memory together are compared, the CPU run having one memory) is planned for rank 0 (for smp, the stage
   with the highest peak) on the meta device with a peerless group, then trained for real on gloo processes: planned
   peak against torch's ``MemTracker``, planned state against the real tensors, planned bytes sent against
   shardkit's comm meter (see :mod:`shardkit.plan.accuracy` for the conventions).
2. **Speed.** ``shardkit plan`` of a 7B Llama-style config (hidden 4096, 32 layers, intermediate 11008,
   vocabulary 32000, sequence 2048, one sequence per rank) at world size 64, every setting, in a child process:
   wall time and peak resident memory.

Options: ``--quick`` (small configs, world size 2, no 7B run; seconds), ``--world-size N`` (only that size),
``--skip-7b``, ``--families`` (only the Hugging Face families). A row that cannot be planned or run says so in
place of its numbers (and counts as a failure in the summary) rather than stopping the table.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from dataclasses import replace
from typing import Union

from shardkit.plan.accuracy import HEADER, Row, compare
from shardkit.plan.workloads import Workload

STRATEGIES = ["ddp", "oss_ddp", "oss_sdp", "fsdp", "slowmo"]
#: smp's settings in the accuracy table.
PIPELINE_OPTIONS = {"partitions": 2, "microbatches": 2}
#: FSDP with CPU offload in the accuracy table (planned device + host memory against the CPU run's one memory).
OFFLOAD_OPTIONS = {"cpu_offload": True}
LLAMA_7B = "hidden_size=4096,num_hidden_layers=32,intermediate_size=11008,vocab_size=32000,num_attention_heads=32"


def hf_families() -> list[tuple[str, Workload]]:
    """Hugging Face model families shardkit does not ship, small enough for a 2-core machine, each trained with its
    own head and loss (:mod:`shardkit.plan.hf_tasks`)."""
    small = {"vocab_size": 2000}
    return [
        (
            "BERT MLM (2 layers, 128 wide)",
            Workload.hf("bert", {**small, "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
                                 "intermediate_size": 512, "max_position_embeddings": 256}, batch_size=2, seq_len=256),
        ),
        (
            "T5 (2+2 layers, 128 wide)",
            Workload.hf("t5", {**small, "num_layers": 2, "num_decoder_layers": 2, "d_model": 128, "d_ff": 512,
                               "num_heads": 4, "d_kv": 32}, batch_size=2, seq_len=128),
        ),
        (
            "Llama GQA (2 layers, 128 wide)",
            Workload.hf("llama", {**small, "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "intermediate_size": 384}, batch_size=2, seq_len=256),
        ),
        (
            "ViT (2 layers, 128 wide, 128 px)",
            Workload.hf("vit", {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
                                "intermediate_size": 512, "image_size": 128, "patch_size": 16}, batch_size=4),
        ),
    ]  # fmt: skip


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


def _rows(label: str, work: Workload, world_size: int) -> list[Union[Row, str]]:
    """Every strategy's row for ``work`` at ``world_size`` (smp with 2 partitions; FSDP also with CPU offload); a
    line saying why in place of a group of rows that could not be planned or run."""
    groups = [
        (work, STRATEGIES, ""),
        (replace(work, strategy_options=PIPELINE_OPTIONS), ["smp"], ""),
        (replace(work, strategy_options=OFFLOAD_OPTIONS), ["fsdp"], "fsdp + cpu offload"),
    ]
    rows: list[Union[Row, str]] = []
    for group_work, strategies, rename in groups:
        try:
            found = compare(group_work, strategies, world_size, label)
        except Exception as exc:  # one model a strategy cannot take must not hide the rest of the table
            message = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ""
            rows.append(f"| {label} | {', '.join(strategies)} | {world_size} | did not run: {type(exc).__name__}: "
                        f"{message} |")  # fmt: skip
            continue
        rows += [replace(row, strategy=rename) if rename else row for row in found]
    return rows


def run(argv: list[str]) -> None:
    """Print the accuracy table and the 7B planning time (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="shardkit bench plan", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small configs, world size 2, no 7B run")
    parser.add_argument("--world-size", type=int, default=None, help="only this world size")
    parser.add_argument("--skip-7b", action="store_true", help="leave out the 7B planning run")
    parser.add_argument("--families", action="store_true", help="only the Hugging Face families (world size 2)")
    parser.add_argument("--steps", type=int, default=None, help="ignored (the plan runs a fixed step count)")
    parser.add_argument("--warmup", type=int, default=None, help="ignored")
    args = parser.parse_args(argv)
    sizes = [args.world_size] if args.world_size else ([2] if args.quick else [2, 4])
    tables = [] if args.families else [(label, work, sizes) for label, work in _workloads(args.quick)]
    if not args.quick:
        tables += [(label, work, [args.world_size or 2]) for label, work in hf_families()]
    print(HEADER, flush=True)
    worst_peak = worst_state = 0.0
    unequal = failed = 0
    for label, work, world_sizes in tables:
        for world_size in world_sizes:
            for row in _rows(label, work, world_size):
                if isinstance(row, str):
                    print(row, flush=True)
                    failed += 1
                    continue
                print(row.format(), flush=True)
                worst_peak = max(worst_peak, abs(row.peak_error))
                worst_state = max(worst_state, abs(row.state_error))
                unequal += row.planned_comm != row.real_comm
    print(
        f"\nlargest peak error {worst_peak:.1%}, largest state error {worst_state:.1%}, "
        f"rows whose bytes sent differ: {unequal}, rows that did not run: {failed}"
    )
    if args.quick or args.skip_7b:
        return
    seconds, rss, output = plan_7b_seconds()
    print(f"\n7B Llama-style config, world size 64, every setting: {seconds:.1f} s, peak RSS {rss / 2**20:.0f} MiB")
    print(output)
