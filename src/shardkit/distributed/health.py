"""Make distributed failures loud and specific instead of silent hangs.

Two tools, both built into shardkit's labelled collectives:

- **Failure reports.** From its first shardkit collective on, each process records in the process group's store
  how it ends (:mod:`.departures`): "rank R failed: <error>" from an exception hook (or :func:`report_failure`),
  or that it left without an error. When a collective on another rank then errors or times out, the error names
  the failed rank and its exception (:class:`RankFailedError`), or the rank that left while the others were still
  in the collective (:class:`PeerLeftError`, with what uneven steps need), instead of only "connection closed".
- **Collective checks** (debug mode, :func:`check_collectives` or ``SHARDKIT_CHECK_COLLECTIVES=1``). Before
  every collective, ranks exchange a small fingerprint (sequence number, op, label, size, dtype) and raise
  :class:`CollectiveMismatchError` naming the first rank whose call differs. A rank that skipped a collective
  is found either by the mismatch it causes at its next collective or, if it issues none, by the timeout,
  whose message lists where every rank last was. Costs one tiny all-gather per collective: a debugging aid.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from shardkit.distributed.departures import DEPARTURES, default_store, lost_a_peer, read_record
from shardkit.distributed.groups import all_gather_flat
from shardkit.distributed.instrumentation import INSTRUMENTATION, CheckState
from shardkit.distributed.objects import all_gather_objects

_PREFIX = "shardkit/health"


class CollectiveMismatchError(RuntimeError):
    """Ranks issued different collectives at the same point of the program."""


class RankFailedError(RuntimeError):
    """A collective failed because another rank raised or died; the message names it."""


class PeerLeftError(RuntimeError):
    """A collective failed because a peer's process ended without reporting an error (it finished, or was killed)."""


@contextlib.contextmanager
def check_collectives(timeout_s: float = 60.0) -> Iterator[None]:
    """Verify that every rank issues the same shardkit collectives, in the same order, inside the block.

    The check applies to collectives issued on any thread while the block is open (on CUDA, backward hooks run
    on autograd's device threads).

    Example::

        with check_collectives(timeout_s=30):
            loss = model(batch).sum()
            loss.backward()     # a rank that skips or reorders a collective raises on every rank
    """
    with INSTRUMENTATION.checks.opened(CheckState(timeout_s)):
        yield


def active_check_timeout_s() -> Optional[float]:
    """The timeout of the active collective checks (:func:`check_collectives` or the environment), else None."""
    state = INSTRUMENTATION.active_checks()
    return state.timeout_s if state is not None else None


def report_failure(error: BaseException) -> None:
    """Record in the process group's store that this rank failed with ``error`` (best effort, never raises)."""
    DEPARTURES.report_failure(error)


def install_failure_reporter() -> None:
    """Record how this process ends (an uncaught exception, or a clean exit) for the other ranks to read.

    shardkit does this itself from the first collective on; calling it earlier costs nothing."""
    DEPARTURES.watch()


def failed_ranks() -> dict[int, str]:
    """Ranks that reported a failure through :func:`report_failure`, with their error."""
    return DEPARTURES.records("failed")


def _last_collectives() -> dict[int, str]:
    store = default_store()
    if store is None:
        return {}
    found = {}
    for rank in range(dist.get_world_size()):
        message = read_record(store, f"{_PREFIX}/last/{rank}")
        found[rank] = message or "no checked collective yet"
    return found


#: What a rank whose peer left in the middle of a collective should check, said with the error.
UNEVEN_HINT = (
    "If the ranks run different numbers of steps (uneven data), the first to finish leaves the others in a "
    "collective: give every rank the same number of batches (DistributedSampler(..., drop_last=True), or stop every "
    "rank when the shortest runs out), or use join() where the wrapper has one (torch DDP's Join, smp's "
    "DistributedModel.join())."
)


def explain_failure(error: BaseException, what: str) -> RuntimeError:
    """Turn a collective's low-level error into one that names failed ranks (and, in debug mode, positions)."""
    me = dist.get_rank() if dist.is_initialized() else 0
    lost = lost_a_peer(error)
    failures, left = DEPARTURES.await_records() if lost else (failed_ranks(), {})
    if lost and not failures:
        return _peer_left(error, what, me, left)
    if failures:  # the failed rank's own error first: the backend's words only say the connection went
        lines = [f"shardkit collective {what} failed on rank {me} because another rank raised an error:"]
        lines += [f"  rank {rank} failed first: {message}" for rank, message in sorted(failures.items())]
        lines += _whereabouts() + [f"  (the backend said: {_first_line(error)})"]
        return RankFailedError("\n".join(lines))
    lines = [f"shardkit collective {what} failed on rank {me}: {error}", *_whereabouts()]
    lines.append(
        "  no rank reported an error: a rank may have died, or skipped this collective (run with "
        "SHARDKIT_CHECK_COLLECTIVES=1 to find which)"
    )
    return RuntimeError("\n".join(lines))


def _whereabouts() -> list[str]:
    """In debug mode, where every rank last was."""
    if INSTRUMENTATION.active_checks() is None:
        return []
    return [f"  rank {rank} last entered: {last}" for rank, last in sorted(_last_collectives().items())]


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0]


def _peer_left(error: BaseException, what: str, me: int, left: dict[int, str]) -> PeerLeftError:
    if left:
        ranks = ", ".join(str(rank) for rank in sorted(left))
        gone = f"rank(s) {ranks} left the job while this rank was in {what}: {left[min(left)]}"
    else:
        gone = (
            f"a peer rank left the job while this rank was in {what}: its process ended, because it finished or "
            "died without reporting an error (killed, out of memory, os._exit)"
        )
    return PeerLeftError(
        f"shardkit collective {what} failed on rank {me}: {gone}. {UNEVEN_HINT} (The backend said: "
        f"{_first_line(error)})"
    )


_OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "send", "recv")


def verify_matching(group: Any, op: str, label: str, tensor: torch.Tensor) -> None:
    """In debug mode, check that every rank of ``group`` is about to issue the same collective."""
    state = INSTRUMENTATION.active_checks()
    if state is None or op in ("send", "recv"):
        return
    seq = state.next_seq(group)
    desc = f"#{seq} {op}:{label or '-'} numel={tensor.numel()} dtype={tensor.dtype}"
    store = default_store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(f"{_PREFIX}/last/{dist.get_rank()}", desc)
    n = dist.get_world_size(group)
    dtype_code = zlib.crc32(str(tensor.dtype).encode()) & 0x7FFFFFFF
    label_code = zlib.crc32(label.encode()) & 0x7FFFFFFF
    mine = torch.tensor(
        [seq, _OPS.index(op), tensor.numel(), dtype_code, label_code], dtype=torch.int64, device=tensor.device
    )
    everyone = torch.empty(n * mine.numel(), dtype=torch.int64, device=tensor.device)
    work = all_gather_flat(everyone, mine, group=group, async_op=True)
    try:
        assert work is not None
        work.wait(timeout=timedelta(seconds=state.timeout_s))
    except Exception as err:
        raise explain_failure(err, f"check before {desc}") from err
    rows = everyone.view(n, -1)
    if bool((rows == mine).all()):
        return
    descriptions = all_gather_objects(desc, group, f"check.{label or '-'}")
    detail = "\n".join(f"  rank {r} (in group) issued {d}" for r, d in enumerate(descriptions))
    first = next(r for r in range(n) if descriptions[r] != descriptions[0])
    raise CollectiveMismatchError(
        f"ranks issued different collectives; first mismatch at rank {first} (in group):\n{detail}\n"
        "Every rank must run the same collectives in the same order: look for a branch on rank, data-dependent "
        "control flow or a module that ran on some ranks only."
    )
