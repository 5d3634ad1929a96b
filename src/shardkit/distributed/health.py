"""Make distributed failures loud and specific instead of silent hangs.

Two tools, both built into shardkit's labelled collectives:

- **Failure reports.** :func:`report_failure` (installed as an exception hook by
  :func:`install_failure_reporter`) writes "rank R failed: <error>" into the process group's store before the
  process dies. When a collective on another rank then errors or times out, the error names the failed rank
  and its exception instead of only "connection closed".
- **Collective checks** (debug mode, :func:`check_collectives` or ``SHARDKIT_CHECK_COLLECTIVES=1``). Before
  every collective, ranks exchange a small fingerprint (sequence number, op, label, size, dtype) and raise
  :class:`CollectiveMismatchError` naming the first rank whose call differs. A rank that skipped a collective
  is found either by the mismatch it causes at its next collective or, if it issues none, by the timeout,
  whose message lists where every rank last was. Costs one tiny all-gather per collective: a debugging aid.
"""

from __future__ import annotations

import contextlib
import sys
import zlib
from collections.abc import Iterator
from datetime import timedelta
from types import TracebackType
from typing import Any, Optional

import torch
import torch.distributed as dist

from shardkit.distributed._torch_private import default_store as torch_default_store
from shardkit.distributed.groups import all_gather_flat
from shardkit.distributed.instrumentation import INSTRUMENTATION, CheckState
from shardkit.distributed.objects import all_gather_objects

_PREFIX = "shardkit/health"


class CollectiveMismatchError(RuntimeError):
    """Ranks issued different collectives at the same point of the program."""


class RankFailedError(RuntimeError):
    """A collective failed because another rank raised or died; the message names it."""


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


def default_store() -> Optional[dist.Store]:
    """The key-value store the default process group rendezvoused through, or None without one.

    shardkit keeps small out-of-band records there (failed ranks, where each rank last was) that must be
    readable while collectives hang. torch exposes the store only privately; this is the one place that asks.
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return torch_default_store()
    except Exception:
        return None


def report_failure(error: BaseException) -> None:
    """Record in the process group's store that this rank failed with ``error`` (best effort, never raises)."""
    store = default_store()
    if store is None:
        return
    with contextlib.suppress(Exception):
        store.set(f"{_PREFIX}/failed/{dist.get_rank()}", f"{type(error).__name__}: {error}"[:2000])


def install_failure_reporter() -> None:
    """Chain an exception hook that calls :func:`report_failure` for uncaught exceptions of this process."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
        report_failure(value)
        previous(kind, value, tb)

    sys.excepthook = hook


def _read(store: dist.Store, key: str) -> Optional[str]:
    with contextlib.suppress(Exception):
        if store.check([key]):
            return store.get(key).decode(errors="replace")
    return None


def failed_ranks() -> dict[int, str]:
    """Ranks that reported a failure through :func:`report_failure`, with their error."""
    store = default_store()
    if store is None:
        return {}
    found = {}
    for rank in range(dist.get_world_size()):
        message = _read(store, f"{_PREFIX}/failed/{rank}")
        if message is not None:
            found[rank] = message
    return found


def _last_collectives() -> dict[int, str]:
    store = default_store()
    if store is None:
        return {}
    found = {}
    for rank in range(dist.get_world_size()):
        message = _read(store, f"{_PREFIX}/last/{rank}")
        found[rank] = message or "no checked collective yet"
    return found


def explain_failure(error: BaseException, what: str) -> RuntimeError:
    """Turn a collective's low-level error into one that names failed ranks (and, in debug mode, positions)."""
    lines = [f"shardkit collective {what} failed on rank {dist.get_rank() if dist.is_initialized() else 0}: {error}"]
    failures = failed_ranks()
    for rank, message in sorted(failures.items()):
        lines.append(f"  rank {rank} failed first: {message}")
    if INSTRUMENTATION.active_checks() is not None:
        for rank, last in sorted(_last_collectives().items()):
            lines.append(f"  rank {rank} last entered: {last}")
    if failures:
        return RankFailedError("\n".join(lines))
    lines.append(
        "  no rank reported an error: a rank may have died, or skipped this collective (run with "
        "SHARDKIT_CHECK_COLLECTIVES=1 to find which)"
    )
    return RuntimeError("\n".join(lines))


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
