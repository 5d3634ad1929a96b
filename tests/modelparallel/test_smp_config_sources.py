"""smp.init() finds its config where SageMaker puts it ($SM_HP_MP_PARAMETERS), takes smp v1's keys and string
values, and names every key it cannot honour in one error; bad input fails on every rank before any collective."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import shardkit.modelparallel as smp
from shardkit.modelparallel.config import ModelParallelConfig, resolve_config
from shardkit.modelparallel.config_sources import CONFIG_ENV_VAR, NO_EFFECT, SAGEMAKER_ENV_VAR
from shardkit.testing import run_distributed


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SAGEMAKER_ENV_VAR, raising=False)
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)


def test_sagemaker_variable_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    params = {"ddp": True, "microbatches": 4, "partitions": 2, "pipeline": "interleaved"}
    monkeypatch.setenv(SAGEMAKER_ENV_VAR, json.dumps(params))
    cfg = resolve_config(None)
    assert (cfg.partitions, cfg.microbatches, cfg.ddp, cfg.pipeline) == (2, 4, True, "interleaved")


def test_string_typed_values_are_converted(monkeypatch: pytest.MonkeyPatch) -> None:
    params = {"partitions": "2", "ddp": "true", "microbatches": "4", "memory_weight": "0.5", "auto_partition": "False"}
    monkeypatch.setenv(SAGEMAKER_ENV_VAR, json.dumps(params))
    cfg = resolve_config(None)
    assert (cfg.partitions, cfg.ddp, cfg.microbatches, cfg.memory_weight, cfg.auto_partition) == (
        2,
        True,
        4,
        0.5,
        False,
    )
    monkeypatch.setenv(SAGEMAKER_ENV_VAR, json.dumps(json.dumps({"partitions": 2})))  # JSON text encoded twice
    assert resolve_config(None).partitions == 2
    monkeypatch.setenv(SAGEMAKER_ENV_VAR, json.dumps({"ddp": "yes"}))
    with pytest.raises(ValueError, match=r"'ddp' from \$SM_HP_MP_PARAMETERS must be true or false, got 'yes'"):
        resolve_config(None)


def test_order_dict_then_sagemaker_then_shardkit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CONFIG_ENV_VAR, json.dumps({"microbatches": 3}))
    assert resolve_config(None).microbatches == 3
    monkeypatch.setenv(SAGEMAKER_ENV_VAR, json.dumps({"microbatches": 2}))
    assert resolve_config(None).microbatches == 2
    assert resolve_config({"microbatches": 5}).microbatches == 5


def test_shardkit_variable_may_name_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "smp.json"
    path.write_text(json.dumps({"microbatches": 8, "pipeline": "simple"}))
    monkeypatch.setenv(CONFIG_ENV_VAR, str(path))
    cfg = resolve_config(None)
    assert (cfg.microbatches, cfg.pipeline) == (8, "simple")
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"SHARDKIT_SMP_CONFIG \(file .*smp.json\) must hold a JSON object"):
        resolve_config(None)
    monkeypatch.setenv(CONFIG_ENV_VAR, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"JSON object of smp config keys or the path of a file.*no such file"):
        resolve_config(None)


def test_malformed_sagemaker_variable_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SAGEMAKER_ENV_VAR, '{"partitions": 2,')
    with pytest.raises(ValueError, match=r"\$SM_HP_MP_PARAMETERS must hold a JSON object.*not valid JSON"):
        resolve_config(None)
    monkeypatch.setenv(SAGEMAKER_ENV_VAR, "[2, 4]")
    with pytest.raises(ValueError, match=r"\$SM_HP_MP_PARAMETERS must hold a JSON object of smp config keys, got list"):
        resolve_config(None)


def test_unsupported_and_unknown_keys_in_one_error() -> None:
    values = {"load_partition": True, "micro_batches": 4, "horovod": True}
    with pytest.raises(ValueError) as info:
        ModelParallelConfig.from_dict(values)
    message = str(info.value)
    assert "load_partition=True: loading a saved partition decision is not supported" in message
    assert "'micro_batches': not an smp config key" in message
    assert "horovod=True" in message
    # Their neutral values are fine.
    neutral = {"tensor_parallel_degree": 1, "load_partition": "false", "horovod": False}
    assert ModelParallelConfig.from_dict(neutral) == ModelParallelConfig()


def test_no_effect_keys_are_accepted_and_recorded() -> None:
    values = {"skip_tracing": "true", "offload_activations": True, "activation_loading_horizon": 4}
    values |= {"static_mode": True, "fast_mode": True, "active_microbatches": "3"}
    cfg = ModelParallelConfig.from_dict(values)
    assert dict(cfg.accepted) == {
        "skip_tracing": True, "offload_activations": True, "activation_loading_horizon": 4,
        "static_mode": True, "fast_mode": True, "active_microbatches": 3,
    }  # fmt: skip
    assert set(values) <= set(NO_EFFECT)
    with pytest.raises(ValueError, match=r"activation_loading_horizon' from .* must be an int"):
        ModelParallelConfig.from_dict({"activation_loading_horizon": "soon"})
    with pytest.raises(TypeError, match=r"'skip_tracing' from a dict must be a bool, got 1"):
        ModelParallelConfig.from_dict({"skip_tracing": 1})
    assert dict(ModelParallelConfig.from_dict({"ddp_port": 29600}).accepted) == {"ddp_port": 29600}


def test_placement_permutations_and_precision_keys() -> None:
    assert ModelParallelConfig.from_dict({"placement_strategy": "dpt"}).placement_strategy == "DPT"
    assert ModelParallelConfig.from_dict({"placement_strategy": "spread"}).placement_order == "TPD"
    assert ModelParallelConfig.from_dict({"fp16": "true"}).fp16
    with pytest.raises(ValueError, match="both fp16 and bf16"):
        ModelParallelConfig.from_dict({"fp16": True, "bf16": True})


def _init_from_environment(rank: int, world_size: int) -> dict[str, Any]:
    smp.init()  # as a SageMaker script calls it
    try:
        return {"mp_size": smp.mp_size(), "dp_size": smp.dp_size(), "mp_rank": smp.mp_rank()}
    finally:
        smp.reset()


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"partitions": 2, "microbatches": 4, "pipeline": "interleaved"}, [(2, 1, 0), (2, 1, 1)]),
        ({"partitions": "1", "ddp": "true", "microbatches": "4"}, [(1, 2, 0), (1, 2, 0)]),
    ],
)
def test_plain_init_reads_sagemaker_variable_on_every_rank(params: dict[str, Any], expected: list[Any]) -> None:
    env = [{SAGEMAKER_ENV_VAR: json.dumps(params)}] * 2
    results = run_distributed(_init_from_environment, 2, rank_env=env, timeout_s=60)
    assert [(r["mp_size"], r["dp_size"], r["mp_rank"]) for r in results] == expected


def _init_malformed(rank: int, world_size: int) -> dict[str, Any]:
    try:
        smp.init()
    except ValueError as err:
        message = str(err)
    else:
        smp.reset()
        raise AssertionError("smp.init() accepted a malformed $SM_HP_MP_PARAMETERS")
    initialised = smp.is_initialized()
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, rank)  # the group is intact: no rank is stuck in a collective of smp.init
    return {"message": message, "initialised": initialised, "gathered": gathered}


def test_malformed_sagemaker_variable_fails_on_every_rank_before_any_collective() -> None:
    env = [{SAGEMAKER_ENV_VAR: '{"partitions": 2, "ddp": tru}'}] * 2
    results = run_distributed(_init_malformed, 2, rank_env=env, timeout_s=60)
    for result in results:
        assert "$SM_HP_MP_PARAMETERS must hold a JSON object of smp config keys" in result["message"]
        assert not result["initialised"] and result["gathered"] == [0, 1]
