"""The virtual-stage tick exchange cannot deadlock on a transport whose sends block (NCCL), and delivers every
message to its chunk: p threads drive real :class:`ChunkLink` s through the interleaved and the ZBV tick grids over
the fake blocking transport of ``testkit.blocking_transport`` (a send completes only while the peer's matching receive
runs, one group at a time per rank)."""

from __future__ import annotations

import threading

import pytest
import torch

from shardkit.modelparallel.pipeline.virtual_p2p import ChunkLink, Expected
from shardkit.modelparallel.schedules.virtual_schedules import ChunkAction, placement, schedule_grid
from shardkit.modelparallel.topology import Topology
from testkit.blocking_transport import FakeTransport, RendezvousWorld

CPU = torch.device("cpu")


def _expected(row: list[ChunkAction | None], me: int, chunk_ranks: tuple[int, ...]) -> list[Expected]:
    """What the other ranks' actions of a tick send to ``me``: one tensor per chunk-to-chunk hop."""
    out = []
    for rank, a in enumerate(row):
        if a is None or rank == me:
            continue
        dst = a.chunk + 1 if a.kind == "F" else a.chunk - 1
        if a.kind != "W" and 0 <= dst < len(chunk_ranks) and chunk_ranks[dst] == me:
            out.append(Expected((a.kind, a.chunk, dst, a.microbatch, 0), (3,), torch.float32, rank))
    return out


def _rank(
    link: ChunkLink, grid: list[list[ChunkAction | None]], me: int, seen: list[tuple[str, int, int, float]]
) -> None:
    """F of chunk c on micro-batch k receives c-1's value and sends value + 1; B sends back what it got, + 1000."""
    last = len(link.chunk_ranks) - 1
    values: dict[tuple[int, int], float] = {}
    for row in grid:
        a = row[me]
        if a is not None and a.kind != "W":
            link.action = a
            c, k = a.chunk, a.microbatch
            if a.kind == "F":
                value = float(k) if c == 0 else link.recv_many([((3,), torch.float32, c - 1)], CPU, "f")[0][0].item()
                seen.append(("F", c, k, value))
                values[(c, k)] = value
                if c < last:
                    link.send(torch.full((3,), value + 1), c + 1, "f")
            else:
                grad = (
                    values[(c, k)]
                    if c == last
                    else link.recv_many([((3,), torch.float32, c + 1)], CPU, "b")[0][0].item()
                )
                seen.append(("B", c, k, grad))
                if c > 0:
                    link.send(torch.full((3,), grad + 1000), c - 1, "b")
            link.action = None
        link.exchange(_expected(row, me, link.chunk_ranks), CPU)
    link.wait_sends()


@pytest.mark.parametrize(
    ("pipeline", "ranks", "v", "m"),
    [
        ("interleaved", 2, 2, 4),
        ("interleaved", 4, 2, 4),
        ("interleaved", 2, 3, 2),
        ("zbv", 2, 2, 4),
        ("zbv", 4, 2, 8),
        ("dualpipev", 4, 2, 9),
    ],
)
def test_tick_exchange_delivers_every_message_on_blocking_sends(pipeline: str, ranks: int, v: int, m: int) -> None:
    world = RendezvousWorld(ranks)
    chunk_ranks = placement(pipeline, ranks, v)
    grid = schedule_grid(pipeline, ranks, v, m)
    seen: list[tuple[str, int, int, float]] = []
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        topology = Topology(world_size=ranks, rank=rank, mp_size=ranks)
        link = ChunkLink(None, topology, None, chunk_ranks, transport=FakeTransport(world, rank, True))
        try:
            _rank(link, grid, rank, seen)
        except BaseException as err:
            errors.append(err)
        finally:
            world.finished()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "the fake transport itself hung"
    assert errors == []
    chunks = len(chunk_ranks)
    got = {(kind, c, k): value for kind, c, k, value in seen}
    for k in range(m):
        for c in range(chunks):
            assert got[("F", c, k)] == k + c  # each hop adds one
            assert got[("B", c, k)] == k + chunks - 1 + 1000 * (chunks - 1 - c)
