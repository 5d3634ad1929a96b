"""Workers restarted by torchrun (``--max-restarts``) and the rendezvous store they share with the round before.

By default torch's elastic agent lets its workers use the rendezvous TCP store it hosts. After a restart that store
still holds the first round's keys, dead workers' gloo addresses among them, under the same names the new round's
``init_process_group()`` uses: a new worker may read a dead one's address and fail in gloo's ``connectFullMesh``
(or hang; pytorch/pytorch#135712). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment avoids it.

shardkit helps in two ways. Where it starts the process group itself (:func:`init_process_group`: smp's automatic
initialisation, the demo), it gives each restart round keys of its own, so restarts work without the variable.
Where the script calls ``torch.distributed.init_process_group()`` itself, ``import shardkit`` logs what to set
(:func:`warn_if_restarts_will_fail`), before the call that would fail: on every restarted worker as its first line,
and once per node when restarts are allowed but have not happened yet. Reading the environment is all it costs.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Optional

#: The variable that stops torch's agent from sharing its store with the workers.
DISABLE_SHARING = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

_LOG = logging.getLogger("shardkit")


def _int_env(name: str) -> int:
    try:
        return int(os.environ.get(name, "0"))
    except ValueError:
        return 0


def restart_round() -> int:
    """How many times torchrun restarted this worker group (0 outside torchrun)."""
    return _int_env("TORCHELASTIC_RESTART_COUNT")


def shares_agent_store() -> bool:
    """Whether this worker uses the agent's rendezvous store (torchrun without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    in its environment)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def restart_warning() -> Optional[str]:
    """What to set, when this worker was (or may be) restarted over a store still holding the last round's keys."""
    if not shares_agent_store():
        return None
    round_ = restart_round()
    fix = (
        f"set {DISABLE_SHARING}=1 in torchrun's environment (`{DISABLE_SHARING}=1 torchrun --max-restarts N ...`), "
        "or let shardkit start the process group (shardkit.restarts.init_process_group)"
    )
    if round_ > 0:
        return (
            f"shardkit: this worker was restarted by torchrun (restart {round_}) and shares the rendezvous store with "
            "the round before, which still holds the dead workers' addresses: torch.distributed.init_process_group() "
            f"can fail in gloo's connectFullMesh or hang (pytorch/pytorch#135712). To restart reliably, {fix}."
        )
    if _int_env("TORCHELASTIC_MAX_RESTARTS") > 0 and _int_env("LOCAL_RANK") == 0:
        return (
            "shardkit: torchrun may restart these workers (--max-restarts), but they share its rendezvous store: a "
            "restarted worker's torch.distributed.init_process_group() can fail in gloo's connectFullMesh or hang "
            f"(pytorch/pytorch#135712). {fix[0].upper()}{fix[1:]}."
        )
    return None


def warn_if_restarts_will_fail() -> None:
    """Log :func:`restart_warning` on the ``shardkit`` logger, if there is one (``import shardkit`` calls it)."""
    message = restart_warning()
    if message is not None:
        _LOG.warning(message)


def init_process_group(backend: str, timeout: timedelta) -> None:
    """``torch.distributed.init_process_group(backend)`` from torchrun's environment, restart-safe.

    A restarted worker sharing the agent's store gets keys of its own round (a prefix over the same store), so it
    never reads the addresses of the round before; otherwise this is torch's own call.

    Example::

        init_process_group("gloo", timedelta(minutes=30))   # under torchrun --max-restarts 3
    """
    # start-up cost: `import shardkit` reads this module, and must not import torch
    import torch.distributed as dist

    if restart_round() == 0 or not shares_agent_store():
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    store = dist.PrefixStore(f"shardkit/restart-{restart_round()}", agent_store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


__all__ = [
    "DISABLE_SHARING",
    "init_process_group",
    "restart_round",
    "restart_warning",
    "shares_agent_store",
    "warn_if_restarts_will_fail",
]
