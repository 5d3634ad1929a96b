"""The pipeline's point-to-point traffic cannot deadlock on a transport whose sends block (NCCL).

CPU has no NCCL, so a fake transport models its rule in one process: each rank runs what it posted in order, one
group at a time (one stream); a send completes only when the peer's matching receive is running, and the
operations of one group run together. Two threads play the two stages of a 1F1B schedule through the real
:class:`StageLink`. Posting each message on its own (what gloo does) deadlocks under that rule; the link's
batching (sends held back and posted with the next receives) completes and delivers every tensor.
"""

from __future__ import annotations

import gc
import itertools
import threading
import weakref
from collections.abc import Sequence

import pytest
import torch

from shardkit.modelparallel.pipeline.pipeline_parallel import one_f_one_b_schedule
from shardkit.modelparallel.pipeline.pp_communications import Message, StageLink
from testkit.blocking_transport import Deadlock, FakeTransport, RendezvousWorld


class _Topology:
    def stage_rank(self, stage: int) -> int:
        return stage


def _run_stage(link: StageLink, stage: int, microbatches: int, got: dict[str, list[torch.Tensor]]) -> None:
    """Stage 0 sends activation k and receives its gradient; stage 1 receives it and returns 2 * activation."""
    received: dict[int, torch.Tensor] = {}
    for action in one_f_one_b_schedule(stage, 2, microbatches):
        k = action.microbatch
        if stage == 0 and action.kind == "F":
            link.send(torch.full((3,), float(k + 1)), 1, "fwd")
        elif stage == 0:
            got["grads"] += link.recv_many([((3,), torch.float32, 1)], torch.device("cpu"), "bwd")
        elif action.kind == "F":
            (received[k],) = link.recv_many([((3,), torch.float32, 0)], torch.device("cpu"), "fwd")
        else:
            link.send(received.pop(k) * 2, 0, "bwd")
    link.wait_sends()


def _pipeline(batches: bool, microbatches: int = 4) -> tuple[dict[str, list[torch.Tensor]], list[BaseException]]:
    world = RendezvousWorld(2)
    got: dict[str, list[torch.Tensor]] = {"grads": []}
    errors: list[BaseException] = []

    def stage(rank: int) -> None:
        link = StageLink(None, _Topology(), None, transport=FakeTransport(world, rank, batches))  # type: ignore[arg-type]
        try:
            _run_stage(link, rank, microbatches, got)
        except BaseException as err:
            errors.append(err)
        finally:
            world.finished()

    threads = [threading.Thread(target=stage, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "the fake transport itself hung"
    return got, errors


def test_unbatched_posting_deadlocks_on_blocking_sends() -> None:
    # The fake models the hazard: posting each message alone, as on gloo, hangs 1F1B with two stages.
    _, errors = _pipeline(batches=False)
    assert errors and all(isinstance(e, Deadlock) for e in errors)


@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_stage_link_batches_sends_with_receives(microbatches: int) -> None:
    got, errors = _pipeline(batches=True, microbatches=microbatches)
    assert errors == []
    expected = [torch.full((3,), 2.0 * (k + 1)) for k in range(microbatches)]
    assert len(got["grads"]) == microbatches
    assert all(torch.equal(a, b) for a, b in zip(got["grads"], expected))


def test_flush_posts_held_sends_before_a_broadcast() -> None:
    world = RendezvousWorld(2)
    link = StageLink(None, _Topology(), None, transport=FakeTransport(world, 0, True))  # type: ignore[arg-type]
    link.send(torch.ones(2), 1, "fwd")
    assert world.streams[0] == []  # held back
    link.flush()
    assert [op.kind for g in world.streams[0] for op in g.ops] == ["send"]
    assert list(itertools.chain.from_iterable(g.ops for g in world.streams[1])) == []


class _Done:
    def wait(self) -> None:
        pass

    def is_completed(self) -> bool:
        return False  # in flight until waited on


class _WeakTransport:
    """Holds no reference to what it sends: only the link can keep a payload alive while it is in flight."""

    def __init__(self, batches: bool) -> None:
        self.batches = batches
        self.sent: list[weakref.ref[torch.Tensor]] = []

    def post(self, sends: Sequence[Message], recvs: Sequence[Message]) -> list[_Done]:
        self.sent += [weakref.ref(m.tensor) for m in sends]
        return [_Done()]


@pytest.mark.parametrize("batches", [False, True])
def test_send_payloads_live_until_their_handles_are_waited(batches: bool) -> None:
    # On CUDA a freed payload is memory the next kernel may overwrite while the send still reads it.
    transport = _WeakTransport(batches)
    link = StageLink(None, _Topology(), None, transport=transport)  # type: ignore[arg-type]
    for _ in range(3):
        link.send(torch.randn(4) * 2, 1, "fwd", private=True)
    link.flush()
    gc.collect()
    assert len(transport.sent) == 3 and all(ref() is not None for ref in transport.sent)
    link.wait_sends()
    gc.collect()
    assert all(ref() is None for ref in transport.sent)
