"""A DDP comm hook that routes DDP's gradient all-reduce through shardkit's labelled collectives.

Benchmarks compare DDP with shardkit's strategies under the same instruments: with this hook DDP's bucket
all-reduce is counted by ``count_comm_bytes`` (intra- and inter-node) and slowed by ``comm_delay`` like every other
collective, which DDP's own C++ reducer would bypass.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from shardkit.distributed import collectives


def labelled_allreduce_hook(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with shardkit's all-reduce (label ``ddp.grad_bucket``).

    A waiter thread completes DDP's future, so the all-reduce (and any simulated delay) overlaps the rest of
    backward as DDP's own asynchronous all-reduce would.

    Example::

        ddp = DistributedDataParallel(model)
        ddp.register_comm_hook(dist.group.WORLD, labelled_allreduce_hook)
    """
    tensor = bucket.buffer().div_(group.size())
    handle = collectives.all_reduce(tensor, group=group, async_op=True, label="ddp.grad_bucket")
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def finish() -> None:
        try:
            handle.wait()
            future.set_result(tensor)
        except BaseException as exc:
            future.set_exception(exc)  # type: ignore[arg-type]

    threading.Thread(target=finish, daemon=True).start()
    return future


# DDP checks a hook's annotations against the real classes; with postponed annotations they would be strings.
labelled_allreduce_hook.__annotations__ = {
    "group": dist.ProcessGroup,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
