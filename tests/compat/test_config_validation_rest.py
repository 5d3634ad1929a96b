"""Settings dataclasses check their own fields: no invalid one can be built, directly or by dataclasses.replace."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest

from shardkit.bench.fsdp import FsdpSettings
from shardkit.bench.pipeline import PipelineSettings
from shardkit.bench.slowmo import SlowMoBenchSettings
from shardkit.bench.zero import ZeroSettings
from shardkit.demo.train import DemoSettings
from shardkit.lightning.config import FullyShardedConfig
from shardkit.nn.sharded_ddp import ReducePolicy, SyncPolicy
from shardkit.nn.slowmo import GossipConfig, LocalSGDConfig, SlowMomentumConfig, WrapperConfig
from shardkit.nn.slowmo.config import SlowMoConfig
from shardkit.testing.models import LMConfig

#: Values of the wrong type, typed Any so the cases read like the mistakes users make.
NONE: Any = None
ONE: Any = 1
TEXT: Any = "sgp"
FLOAT: Any = 2.5
GOSSIP: Any = GossipConfig()
LOCAL: Any = LocalSGDConfig()

CASES: list[tuple[Callable[[], Any], type[Exception], str]] = [
    (lambda: SlowMomentumConfig(frequency=0), ValueError, "slowmo_frequency"),
    (lambda: SlowMomentumConfig(lr=0.0), ValueError, "slowmo_lr"),
    (lambda: SlowMomentumConfig(momentum=-1.0), ValueError, "slowmo_momentum"),
    (lambda: SlowMomentumConfig(num_shards=0), ValueError, "slowmo_num_shards"),
    (lambda: dataclasses.replace(SlowMomentumConfig(), frequency=FLOAT), ValueError, "slowmo_frequency"),
    (lambda: LocalSGDConfig(frequency=0), ValueError, "localsgd_frequency"),
    (lambda: GossipConfig(synch_freq=-1), ValueError, "synch_freq"),
    (lambda: GossipConfig(overlap=TEXT), TypeError, "overlap"),
    (lambda: WrapperConfig(base_algorithm=TEXT), TypeError, "SlowMoBaseAlgorithm"),
    (lambda: WrapperConfig(comm_device=TEXT), TypeError, "comm_device"),
    (
        lambda: SlowMoConfig(WrapperConfig(), SlowMomentumConfig(), GOSSIP, LOCAL),
        TypeError,
        "local_sgd",
    ),
    (lambda: ReducePolicy(bucket_bytes=-1), ValueError, "reduce_buffer_size"),
    (lambda: ReducePolicy(reduce_fp16=TEXT), TypeError, "reduce_fp16"),
    (lambda: dataclasses.replace(SyncPolicy(), broadcast_buffers=NONE), TypeError, "broadcast_buffers"),
    (lambda: FullyShardedConfig(state_dict_type=TEXT), ValueError, "state_dict_type"),
    (lambda: FullyShardedConfig(fsdp_arguments=(("compute_device", "cpu"),)), ValueError, "compute_device"),
    (lambda: FullyShardedConfig(auto_wrap_policy=ONE), TypeError, "auto_wrap_policy"),
    (lambda: FullyShardedConfig(checkpoint_offload=ONE), TypeError, "offload"),
    (lambda: LMConfig(d_model=30, n_heads=4), ValueError, "divisible by n_heads"),
    (lambda: LMConfig(dropout=1.0), ValueError, "dropout"),
    (lambda: DemoSettings(strategies=(), steps=0), ValueError, "DemoSettings.steps"),
    (lambda: dataclasses.replace(ZeroSettings(strategies=()), warmup=-1), ValueError, "ZeroSettings.warmup"),
    (lambda: FsdpSettings(delay_bytes_per_s=0.0), ValueError, "delay_bytes_per_s"),
    (lambda: PipelineSettings(microbatches=0), ValueError, "microbatches"),
    (lambda: SlowMoBenchSettings(latency_s=-0.1), ValueError, "latency_s"),
]


@pytest.mark.parametrize("build,error,match", CASES)
def test_invalid_settings_cannot_be_built(build: Callable[[], Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        build()


def test_defaults_are_valid() -> None:
    for cls in (SlowMomentumConfig, LocalSGDConfig, GossipConfig, WrapperConfig, ReducePolicy, SyncPolicy):
        cls()
    for settings in (LMConfig, LMConfig.bench, LMConfig.demo, FsdpSettings, PipelineSettings, SlowMoBenchSettings):
        settings()
    DemoSettings(strategies=())
    ZeroSettings(strategies=())
    SlowMoConfig(WrapperConfig(), SlowMomentumConfig(), LocalSGDConfig(), GossipConfig())
    FullyShardedConfig(fsdp_arguments=(("mixed_precision", True),), checkpoint_on=lambda m: True)
    assert SyncPolicy(broadcast_buffers=ONE).broadcast_buffers == 1  # fairscale's truth values keep working
