"""A 2-rank script run under ``torchrun --max-restarts 1`` by test_rel_restarts.py, without
TORCH_DISABLE_SHARE_RDZV_TCP_STORE: rank 1 dies in the first round; the agent restarts both workers.

``python restart_script.py MODE``: ``shardkit`` starts the process group through ``shardkit.restarts`` and runs
two all-reduces (rank 1 dies after the first in round 0); ``report`` starts none (rank 1 dies at once in round 0,
round 1 ends at once): what the workers print before any process group. Each prints ``round R rank r: ...``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from datetime import timedelta

# Each worker's log records go to stdout marked with its rank, before shardkit is imported (it logs at import): the
# test reads one worker's lines in that worker's order, whatever the two workers' lines interleave to.
logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format=f"rank {os.environ.get('RANK')}| %(message)s")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import shardkit.restarts  # noqa: E402


def main(mode: str) -> None:
    round_, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    print(f"round {round_} rank {rank}: started", flush=True)
    if mode == "report":
        if round_ == 0:
            if rank == 1:
                os._exit(3)
            time.sleep(60)  # until the agent stops this worker to restart both
        return
    if round_ > 0 and rank == 1:
        time.sleep(1.0)  # rank 0 reaches the store first, where the dead round's keys are
    shardkit.restarts.init_process_group("gloo", timedelta(seconds=60))
    total = torch.ones(1)
    dist.all_reduce(total)
    if round_ == 0 and rank == 1:
        os._exit(3)  # killed, as a worker is
    dist.all_reduce(total)
    print(f"round {round_} rank {rank}: done {total.item():.0f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
