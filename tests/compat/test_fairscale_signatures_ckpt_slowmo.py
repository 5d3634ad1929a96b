"""Activation checkpointing and SlowMo/gossip accept fairscale 0.4.13's arguments, in its order, with its defaults.

fairscale is not imported: its documented signatures are written below as data. ``NO_DEFAULT`` marks a required
parameter. Ours may add parameters only after fairscale's, and only with defaults.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import pytest

import shardkit.experimental.nn.data_parallel.gossip as gossip
import shardkit.nn.checkpoint.checkpoint_activations as ckpt
from shardkit.experimental.nn import data_parallel as experimental_dp
from shardkit.nn import misc

NO_DEFAULT = object()
Expected = list[tuple[str, Any]]

GRAPH_INIT: Expected = [
    ("rank", NO_DEFAULT),
    ("world_size", NO_DEFAULT),
    ("nprocs_per_node", 1),
    ("local_rank", 0),
    ("peers_per_itr", 1),
]
GOSSIPER_INIT: Expected = [
    ("msg", NO_DEFAULT),
    ("graph", NO_DEFAULT),
    ("device", None),
    ("mixing", None),
    ("logger", None),
    ("rank", None),
    ("world_size", None),
]
SLOWMO_INIT: Expected = [
    ("module", NO_DEFAULT),
    ("nprocs_per_node", NO_DEFAULT),
    ("broadcast_buffers", True),
    ("slowmo_base_algorithm", "localsgd"),  # SlowMoBaseAlgorithm.LOCALSGD, a str enum
    ("slowmo_momentum", 0.5),
    ("slowmo_memory_efficient", True),
    ("slowmo_frequency", 48),
    ("slowmo_lr", 1.0),
    ("slowmo_num_shards", 32),
    ("localsgd_frequency", 3),
    ("graph", None),
    ("mixing", None),
    ("push_sum", True),
    ("overlap", False),
    ("synch_freq", 0),
    ("use_streams", True),
    ("slowmo_sgp_average_params", False),
    ("verbose", False),
    ("profile_mode", False),
    ("process_rank", None),
    ("process_world_size", None),
    ("global_group", None),
    ("master_group", None),
    ("local_node_group", None),
    ("comm_device", None),
]

#: (callable, fairscale's parameters after ``self``).
SIGNATURES: dict[str, tuple[Callable[..., Any], Expected]] = {
    "checkpoint_wrapper": (ckpt.checkpoint_wrapper, [("module", NO_DEFAULT), ("offload_to_cpu", False)]),
    "misc.checkpoint_wrapper": (misc.checkpoint_wrapper, [("module", NO_DEFAULT), ("offload_to_cpu", False)]),
    "disable_checkpointing": (ckpt.disable_checkpointing, []),
    "enable_checkpointing": (ckpt.enable_checkpointing, []),
    "enable_recomputing": (ckpt.enable_recomputing, []),
    "is_checkpointing": (ckpt.is_checkpointing, []),
    "is_recomputing": (ckpt.is_recomputing, []),
    "SlowMoDistributedDataParallel": (gossip.SlowMoDistributedDataParallel.__init__, SLOWMO_INIT),
    "SlowMoDistributedDataParallel.perform_slowmo": (
        gossip.SlowMoDistributedDataParallel.perform_slowmo,
        [("optimizer", NO_DEFAULT), ("fp32_params", None)],
    ),
    "SlowMoDistributedDataParallel.forward": (gossip.SlowMoDistributedDataParallel.forward, [("*inputs", None)]),
    "SlowMoDistributedDataParallel.train": (gossip.SlowMoDistributedDataParallel.train, [("mode", True)]),
    "SlowMoDistributedDataParallel.eval": (gossip.SlowMoDistributedDataParallel.eval, []),
    "SlowMoDistributedDataParallel.state_dict": (gossip.SlowMoDistributedDataParallel.state_dict, []),
    "SlowMoDistributedDataParallel.load_state_dict": (
        gossip.SlowMoDistributedDataParallel.load_state_dict,
        [("state_dict", NO_DEFAULT)],
    ),
    "GraphManager.is_passive": (gossip.GraphManager.is_passive, [("rank", None)]),
    "GraphManager.get_peers": (gossip.GraphManager.get_peers, [("rotate", False)]),
    "GraphManager.get_edges": (gossip.GraphManager.get_edges, [("rotate", False)]),
    "GraphManager.is_regular_graph": (gossip.GraphManager.is_regular_graph, []),
    "GraphManager.is_bipartite_graph": (gossip.GraphManager.is_bipartite_graph, []),
    "GraphManager.is_dynamic_graph": (gossip.GraphManager.is_dynamic_graph, []),
    "MixingManager": (gossip.MixingManager.__init__, [("graph", NO_DEFAULT), ("device", NO_DEFAULT)]),
    "UniformMixing": (gossip.UniformMixing.__init__, [("graph", NO_DEFAULT), ("device", NO_DEFAULT)]),
    "MixingManager.get_mixing_weights": (gossip.MixingManager.get_mixing_weights, [("residual_adjusted", True)]),
    "MixingManager.is_regular": (gossip.MixingManager.is_regular, []),
    "MixingManager.is_uniform": (gossip.UniformMixing.is_uniform, []),
    "PushSum": (gossip.PushSum.__init__, GOSSIPER_INIT),
    "PushPull": (gossip.PushPull.__init__, GOSSIPER_INIT),
    "PushSum.mix": (gossip.PushSum.mix, [("out_msg", NO_DEFAULT), ("ps_weight", NO_DEFAULT)]),
    "PushPull.mix": (gossip.PushPull.mix, [("out_msg", NO_DEFAULT), ("ps_weight", NO_DEFAULT)]),
    "communicate": (gossip.communicate, [("tensors", NO_DEFAULT), ("communication_op", NO_DEFAULT), ("logger", None)]),
    "CudaEventRecorder": (gossip.CudaEventRecorder.__init__, [("event_name", NO_DEFAULT)]),
    "CudaEventRecorder.stop": (gossip.CudaEventRecorder.stop, []),
    "CudaEventRecorder.find_time_elapsed": (gossip.CudaEventRecorder.find_time_elapsed, []),
}
for _graph in (
    "RingGraph",
    "DynamicDirectedExponentialGraph",
    "NPeerDynamicDirectedExponentialGraph",
    "DynamicBipartiteExponentialGraph",
    "DynamicDirectedLinearGraph",
    "DynamicBipartiteLinearGraph",
    "GraphManager",
):
    SIGNATURES[_graph] = (getattr(gossip, _graph).__init__, GRAPH_INIT)

#: What ``fairscale.experimental.nn.data_parallel.gossip`` exports.
GOSSIP_EXPORTS = [
    "SlowMoBaseAlgorithm",
    "SlowMoDistributedDataParallel",
    "PushPull",
    "PushSum",
    "DynamicBipartiteExponentialGraph",
    "DynamicBipartiteLinearGraph",
    "DynamicDirectedExponentialGraph",
    "DynamicDirectedLinearGraph",
    "GraphManager",
    "NPeerDynamicDirectedExponentialGraph",
    "RingGraph",
    "MixingManager",
    "UniformMixing",
    "communicate",
    "CudaEventRecorder",
]


def _accepts(fn: Callable[..., Any], expected: Expected, what: str) -> None:
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named = [e for e in expected if not e[0].startswith("*")]
    for index, (name, default) in enumerate(named):
        assert index < len(positional), f"{what}: fairscale's '{name}' (position {index}) is missing"
        ours = positional[index]
        assert ours.name == name, f"{what}: position {index} is '{ours.name}', fairscale has '{name}'"
        if default is NO_DEFAULT:
            continue  # a default where fairscale has none only accepts more calls
        assert ours.default == default, f"{what}: '{name}' defaults to {ours.default!r}, fairscale's to {default!r}"
    if any(e[0].startswith("*") and not e[0].startswith("**") for e in expected):
        assert any(p.kind is p.VAR_POSITIONAL for p in params), f"{what}: fairscale takes *args"
    extra = [p.name for p in positional[len(named) :] if p.default is inspect.Parameter.empty]
    assert not extra, f"{what}: parameters beyond fairscale's need defaults: {extra}"


@pytest.mark.parametrize("what", sorted(SIGNATURES))
def test_signature_accepts_fairscale_arguments(what: str) -> None:
    fn, expected = SIGNATURES[what]
    _accepts(fn, expected, what)


def test_checkpointing_flag_functions_are_context_managers() -> None:
    for make in (ckpt.disable_checkpointing, ckpt.enable_checkpointing, ckpt.enable_recomputing):
        with make():
            pass
    assert ckpt.is_checkpointing() is False and ckpt.is_recomputing() is False


@pytest.mark.parametrize("name", GOSSIP_EXPORTS)
def test_gossip_package_exports(name: str) -> None:
    assert hasattr(gossip, name), f"shardkit.experimental.nn.data_parallel.gossip lacks fairscale's {name}"


def test_experimental_data_parallel_exports_and_enum_values() -> None:
    assert experimental_dp.SlowMoDistributedDataParallel is gossip.SlowMoDistributedDataParallel
    assert {m.name: m.value for m in gossip.SlowMoBaseAlgorithm} == {"LOCALSGD": "localsgd", "SGP": "sgp"}
    assert issubclass(gossip.SlowMoBaseAlgorithm, str)
