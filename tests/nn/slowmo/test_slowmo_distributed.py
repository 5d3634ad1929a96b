"""Multi-process behaviour beyond the equations: initial sync, buffers, what is communicated when, state_dict
with a push-sum weight, and overlapped gossip with delayed synchronisation. One job runs every check."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from slowmo_reference import Case, PlainSGD, flat_params, make_batch, make_model, simulate

from shardkit.distributed import count_comm_bytes
from shardkit.nn.data_parallel import SlowMoBaseAlgorithm, SlowMoDistributedDataParallel
from shardkit.nn.slowmo.collectives import batched_exchange
from shardkit.testing import run_distributed
from shardkit.testing.models import BatchNormNet

SGP = SlowMoBaseAlgorithm.SGP


def _step(net: SlowMoDistributedDataParallel, opt: PlainSGD, rank: int, step: int) -> None:
    x, y = make_batch(rank, step)
    F.mse_loss(net(x), y).backward()
    opt.step()
    opt.zero_grad()
    net.perform_slowmo(opt)  # type: ignore[arg-type]


def _bytes_per_step(rank: int, steps: int, **kwargs: Any) -> list[int]:
    net = SlowMoDistributedDataParallel(make_model(), 1, broadcast_buffers=False, **kwargs)
    opt = PlainSGD(net.parameters(), lr=0.1)
    per_step = []
    for step in range(steps):
        with count_comm_bytes() as meter:
            _step(net, opt, rank, step)
        per_step.append(meter.total_wire_bytes)
    return per_step


def _initial_sync_and_buffers(rank: int) -> dict[str, Any]:
    torch.manual_seed(rank)  # every rank builds a different model; the wrapper starts them all from rank 0's
    model = BatchNormNet()
    net = SlowMoDistributedDataParallel(model, 1)
    params = flat_params(model).tolist()
    with torch.no_grad():
        model.bn.running_mean.fill_(float(rank))
    net.eval()(torch.randn(3, 8))  # eval: batch norm reads but does not update its statistics
    synced = model.bn.running_mean.tolist()
    quiet = SlowMoDistributedDataParallel(BatchNormNet(), 1, broadcast_buffers=False)
    with torch.no_grad():
        quiet.module.bn.running_mean.fill_(float(rank))
    quiet.eval()(torch.randn(3, 8))
    return dict(params=params, synced=synced, unsynced=quiet.module.bn.running_mean.tolist())


def _state_dict_round_trip(rank: int) -> dict[str, Any]:
    case = Case("skewed", algorithm="sgp", graph="star", skewed=True)
    net = SlowMoDistributedDataParallel(make_model(), 1, **case.wrapper_kwargs(rank, 2))
    opt = PlainSGD(net.parameters(), lr=0.1)
    for step in range(3):
        _step(net, opt, rank, step)
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in net.state_dict().items()}
    restored = SlowMoDistributedDataParallel(make_model(), 1, **case.wrapper_kwargs(rank, 2))
    restored.load_state_dict(state)
    restored_opt = PlainSGD(restored.parameters(), lr=0.1)
    for step in range(3, 5):
        _step(net, opt, rank, step)
        _step(restored, restored_opt, rank, step)
    return dict(
        weight=float(state["ps_weight"][0]),
        original=flat_params(net.module).tolist(),
        restored=flat_params(restored.module).tolist(),
        weights=(float(net.state_dict()["ps_weight"][0]), float(restored.state_dict()["ps_weight"][0])),
    )


def _overlap_mass(rank: int) -> dict[str, Any]:
    # lr=0: only gossip moves parameters, so the sums of numerators and of weights over nodes are conserved
    # once no round is in flight: eval() waits for all of them (up to synch_freq rounds may be in flight).
    case = Case("o", algorithm="sgp", graph="star", skewed=True, overlap=True)
    net = SlowMoDistributedDataParallel(make_model(), 1, synch_freq=3, **case.wrapper_kwargs(rank, 2))
    opt = PlainSGD(net.parameters(), lr=0.0)
    synced = []
    for steps in (range(5), range(5, 9)):
        net.train()
        for step in steps:
            _step(net, opt, rank, step)
        net.eval()
        synced.append((flat_params(net.module).tolist(), float(net.state_dict()["ps_weight"][0])))
    return dict(synced=synced, start=flat_params(make_model()).tolist())


def _all_checks(rank: int, world_size: int) -> dict[str, Any]:
    no_slow = dict(slowmo_momentum=0.0, slowmo_frequency=6)
    return dict(
        sync=_initial_sync_and_buffers(rank),
        localsgd=_bytes_per_step(rank, 6, localsgd_frequency=3, **no_slow),
        sgp=_bytes_per_step(rank, 3, slowmo_base_algorithm=SGP, **no_slow),
        plain=_bytes_per_step(rank, 6, localsgd_frequency=3, slowmo_frequency=6, slowmo_memory_efficient=False),
        sharded=_bytes_per_step(rank, 6, localsgd_frequency=3, slowmo_frequency=6, slowmo_memory_efficient=True),
        state=_state_dict_round_trip(rank),
        overlap=_overlap_mass(rank),
    )


@functools.cache
def _results() -> list[dict[str, Any]]:
    return run_distributed(_all_checks, 2, timeout_s=120)


def test_every_rank_starts_from_rank_zero_and_buffers_follow_rank_zero() -> None:
    r0, r1 = (r["sync"] for r in _results())
    assert r0["params"] == r1["params"]
    assert r1["synced"] == r0["synced"] == [0.0] * 16
    assert r1["unsynced"] == [1.0] * 16 and r0["unsynced"] == [0.0] * 16


def test_localsgd_communicates_only_on_its_averaging_steps() -> None:
    per_step = _results()[0]["localsgd"]
    assert [s for s, b in enumerate(per_step) if b] == [2, 5]
    assert all(b > 0 for b in _results()[0]["sgp"])  # SGP gossips every step


def test_memory_efficient_slow_momentum_costs_about_one_all_reduce() -> None:
    plain, sharded = _results()[0]["plain"], _results()[0]["sharded"]
    assert plain[2] == sharded[2] > 0  # an ordinary LocalSGD average
    # Outer step: plain averages (LocalSGD) and updates locally; sharded reduce-scatters and all-gathers instead.
    assert 0 < sharded[5] <= 1.05 * plain[5]


def test_state_dict_carries_the_push_sum_weight_across_a_restart() -> None:
    for result in _results():
        state = result["state"]
        assert abs(state["weight"] - 1.0) > 0.05  # skewed mixing really moved the weight
        assert torch.allclose(torch.tensor(state["original"]), torch.tensor(state["restored"]), atol=1e-6)
        assert abs(state["weights"][0] - state["weights"][1]) < 1e-6


def test_overlapped_gossip_conserves_mass_at_every_synchronisation() -> None:
    results = [r["overlap"] for r in _results()]
    start = torch.tensor(results[0]["start"])
    for point in range(len(results[0]["synced"])):
        total = sum(torch.tensor(r["synced"][point][0]) for r in results)
        weights = sum(r["synced"][point][1] for r in results)
        assert torch.allclose(total, 2 * start, atol=1e-5) and abs(weights - 2.0) < 1e-5
    assert any(abs(w - 1.0) > 0.05 for r in results for _, w in r["synced"])  # the weights really moved


USER_GROUP_CASES = [
    Case("user_groups_localsgd", localsgd_frequency=2, slowmo_lr=1.3, slowmo_momentum=0.5),
    Case("user_groups_sgp", algorithm="sgp", graph="star", skewed=True, slowmo_lr=1.3, slowmo_momentum=0.5),
]


def _user_groups(rank: int, world_size: int) -> dict[str, Any]:
    """Advanced arguments: the caller's own node and master groups, an explicit comm_device, verbose and
    profile_mode; the trajectory must still be the simulated one."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("shardkit.nn.slowmo").addHandler(handler)
    nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    masters = dist.new_group([0, 2])
    out: dict[str, Any] = {}
    for case in USER_GROUP_CASES:
        net = SlowMoDistributedDataParallel(
            make_model(),
            2,
            local_node_group=nodes[rank // 2],
            master_group=masters if rank % 2 == 0 else None,
            comm_device=torch.device("cpu"),
            verbose=True,
            profile_mode=True,
            process_rank=rank,
            process_world_size=world_size,
            **case.wrapper_kwargs(rank // 2, 2),
        )
        opt = PlainSGD(net.parameters(), lr=case.lr)
        trajectory = []
        for step in range(case.steps):
            _step(net, opt, rank, step)
            trajectory.append((flat_params(net.module).tolist(), float(net.state_dict().get("ps_weight", [1.0])[0])))
        out[case.name] = trajectory
        out[case.name + "_phases"] = sorted(net._timer.seconds)
    out["logged_plans"] = sum("perform" in m or "step " in m for m in records)
    out["batched"] = _batched_two_peers(rank, world_size)
    return out


def _batched_two_peers(rank: int, world_size: int) -> list[float]:
    """The NCCL code path of a gossip round (one batch_isend_irecv), run on gloo with CPU tensors: every rank
    sends to the next two ranks and receives from the previous two, a pattern with cycles."""
    outgoing = {(rank + d) % world_size: torch.full((3,), float(rank)) for d in (1, 2)}
    incoming = {(rank - d) % world_size: torch.empty(3) for d in (1, 2)}
    for handle in batched_exchange(outgoing, incoming, dist.group.WORLD):  # type: ignore[arg-type]
        handle.wait()
    return [incoming[(rank - d) % world_size][0].item() for d in (1, 2)]


@functools.cache
def _user_group_results() -> list[dict[str, Any]]:
    return run_distributed(_user_groups, 4, timeout_s=120)


def test_caller_supplied_groups_and_debug_options_keep_the_simulated_trajectory() -> None:
    results = _user_group_results()
    for case in USER_GROUP_CASES:
        expected = simulate(case, 4, 2)
        for rank, result in enumerate(results):
            for step, (x, w) in enumerate(result[case.name]):
                assert torch.allclose(torch.tensor(x), expected[step][rank][0], rtol=1e-5, atol=1e-6)
                assert abs(w - expected[step][rank][1]) < 1e-5
    assert "slow_momentum" in results[0]["user_groups_localsgd_phases"]
    assert "gossip" in results[0]["user_groups_sgp_phases"] and "gossip" not in results[1]["user_groups_sgp_phases"]
    assert all(r["logged_plans"] >= 16 for r in results)  # verbose: one plan line per step and case
    assert [r["batched"] for r in results] == [[(rank - 1) % 4, (rank - 2) % 4] for rank in range(4)]
