"""Run under torchrun by test_exit_release.py: a script that uses shardkit's process-wide group holders and exits.

``python exit_release_script.py MODE OUT``. ``holders``: a hybrid Topology, the tensor-parallel state and the
asynchronous checkpoint group, then ``destroy_process_group()``, as a user's script ends. ``smp``: ``smp.init``
creates the default group from torchrun's environment and the script ends without destroying anything, as smp
scripts do. Each rank writes to ``OUT/rank<r>.txt`` how many gloo worker threads are still running when the
interpreter's exit handlers are done: each one belongs to a process group that lives on into finalisation.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

# Registered before shardkit is imported, so it runs after shardkit's own exit handler (atexit runs in reverse order).
_OUT: list[Path] = []


def _count_gloo_workers() -> None:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except OSError:
            continue
    if _OUT:
        _OUT[0].write_text(str(names.count("pt_gloo_runloop")))


atexit.register(_count_gloo_workers)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from shardkit import tensor_parallel as tp  # noqa: E402
from shardkit.checkpoint.universal.background import BACKGROUND  # noqa: E402
from shardkit.distributed import Topology  # noqa: E402
from shardkit.distributed import collectives as C  # noqa: E402


def holders() -> None:
    dist.init_process_group("gloo")
    topology = Topology.from_env()
    state = tp.init_parallel_state(tensor=2)
    checkpoint_group = BACKGROUND.group()
    for group in (topology.intra_group, topology.inter_group, state.tp_group, checkpoint_group):
        C.all_reduce(torch.ones(3), group=group, label="exit_release")
    dist.destroy_process_group()


def smp_script() -> None:
    import shardkit.modelparallel as smp

    smp.init({"partitions": 2, "microbatches": 2})
    C.all_reduce(torch.ones(3), label="exit_release")


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    _OUT.append(out / f"rank{os.environ['RANK']}.txt")
    {"holders": holders, "smp": smp_script}[mode]()
