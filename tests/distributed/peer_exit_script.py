"""A 2-rank script run under torchrun by test_peer_exits.py: one rank leaves mid-training, as a user's would.

``python peer_exit_script.py MODE OUT``: ``uneven`` (rank 1 has one batch more than rank 0, which finishes and exits
cleanly) or ``raises`` (rank 1 raises in its own code at the second step). The rank still training writes the
error its collective raised to ``OUT/rank<r>.txt``.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardkit.distributed import collectives as C


def main(mode: str, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "raises" and rank == 0:
        # The agent stops the other workers as soon as one fails; let this one write what it read first.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    steps = 2 + rank if mode == "uneven" else 3
    try:
        for step in range(steps):
            if mode == "raises" and rank == 1 and step == 1:
                raise ValueError("bad batch on purpose")
            C.all_reduce(torch.ones(4), label="grads")
    except RuntimeError as err:
        (out / f"rank{rank}.txt").write_text(f"{type(err).__name__}: {err}")
        return
    (out / f"rank{rank}.txt").write_text("finished")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
