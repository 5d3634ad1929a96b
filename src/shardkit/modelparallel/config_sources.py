"""Where ``smp.init()`` finds its config, and how smp v1's keys translate into shardkit's.

Order: the dict passed to ``smp.init``; else ``$SM_HP_MP_PARAMETERS`` (what SageMaker's launcher sets on every
process: a JSON object of the estimator's ``"parameters"``); else ``$SHARDKIT_SMP_CONFIG`` (a JSON object, or the
path of a file holding one); else the defaults. Every rank reads its own environment before any collective, so a
malformed value fails on every rank with the same message.

Values may arrive as strings (a hyperparameter tuner, or a launcher that passes ``"true"`` and ``"4"``): a key
whose type is known takes ``"true"``/``"false"`` for a bool and a decimal string for a number.

smp v1 keys fall in four kinds, each listed below with its reason: the ones shardkit implements (they become
:class:`~shardkit.modelparallel.config.ModelParallelConfig` fields); the ones accepted with no effect here
because nothing they change exists in shardkit's engine (:data:`NO_EFFECT`); the ones whose feature shardkit
lacks, refused unless given their neutral value (:data:`UNSUPPORTED`); and unknown keys. Every unsupported and
unknown key of a config is reported in one error, an unknown key with the nearest known one. Older spellings of a
key are read as it (:data:`ALIASES`). What shardkit does instead of each no-effect key, when its value would change
something in smp, is logged once at ``smp.init`` (:mod:`~.config_notes`).
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from typing import Any, Optional

#: Environment variable SageMaker sets to the model-parallel parameters (a JSON object).
SAGEMAKER_ENV_VAR = "SM_HP_MP_PARAMETERS"
#: shardkit's own variable: a JSON object, or the path of a JSON file.
CONFIG_ENV_VAR = "SHARDKIT_SMP_CONFIG"

#: The keys shardkit implements and the type of each (strings are converted to it).
CORE_KINDS: dict[str, type] = {
    "partitions": int,
    "pipeline_parallel_degree": int,
    "microbatches": int,
    "pipeline": str,
    "auto_partition": bool,
    "default_partition": int,
    "optimize": str,
    "memory_weight": float,
    "ddp": bool,
    "placement_strategy": str,
    "fp16": bool,
    "bf16": bool,
    "shard_optimizer_state": bool,
    "virtual_stages": int,  # a shardkit addition (see ModelParallelConfig)
    "delayed_parameter_initialization": bool,
    "tensor_parallel_degree": int,
    "prescaled_batch": bool,
    "sharded_data_parallel_degree": int,  # with its sdp_* keys: see modelparallel/sdp/rules.py
    "sdp_reduce_bucket_size": float,
    "sdp_param_persistence_threshold": float,
    "sdp_max_live_parameters": float,
    "sdp_hierarchical_allgather": bool,
    "sdp_gradient_clipping": float,
}

#: smp v1 keys accepted with no effect: their type, and why nothing changes here.
NO_EFFECT: dict[str, tuple[type, str]] = {
    "offload_activations": (bool, "memory only: activations stay on the device (results are the same)"),
    "activation_loading_horizon": (int, "tunes offload_activations, which has no effect"),
    "skip_tracing": (bool, "rank 0 always traces once to partition; results are the same"),
    "static_mode": (bool, "a scheduling optimisation in smp; the schedule here is always static"),
    "fast_mode": (bool, "a communication optimisation in smp; results are the same"),
    "active_microbatches": (int, "the 1F1B schedule already bounds micro-batches in flight per stage"),
    "deterministic_server": (bool, "execution here is always in the same order on every replica"),
    "ddp_port": (int, "replicas communicate over the torch.distributed process group"),
    "ddp_dist_backend": (str, "the backend is the torch.distributed process group's (gloo or NCCL)"),
    "fp16_params": (
        bool,
        "distributed modules take the dtype of the module they replace (or torch's default); under 'fp16' "
        "smp.DistributedModel casts the whole model anyway",
    ),
    "contiguous": (bool, "TensorFlow only"),
}
# ---- keys AWS's large-model scripts pass beside the documented ones (issue 34; their notes: config_notes) ------
NO_EFFECT |= {
    "tensor_parallel_seed": (int, "dropout in the distributed modules draws from torch's random state"),
    "_match_weights": (bool, "replaced nn.Linear / nn.Embedding / Hugging Face modules always keep their weights"),
    "_fp32_grad_accumulation": (bool, "gradients accumulate in the parameters' dtype"),
    "checkpoint_attentions": (bool, "memory only: use smp.set_activation_checkpointing on the transformer layers"),
}
#: Older spellings of implemented keys, and the key each stands for.
ALIASES: dict[str, str] = {"_prescaled_batch": "prescaled_batch"}
#: Keys whose string value must be one of a few (smp's values; the notes say what each does here).
CHOICES: dict[str, tuple[str, ...]] = {"ddp_dist_backend": ("auto", "nccl", "gloo", "smddp")}
#: The smallest value of integer no-effect keys (a count, a horizon, a port).
MINIMUM: dict[str, int] = {"active_microbatches": 1, "activation_loading_horizon": 1, "ddp_port": 1}

#: smp v1 keys whose feature shardkit lacks: the neutral value (accepted), and what to do instead.
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "horovod": (False, "Horovod data parallelism (TensorFlow) is not supported; use 'ddp': true"),
    "load_partition": (False, "loading a saved partition decision is not supported; the partition is recomputed"),
    "partition_file": (None, "loading a saved partition decision is not supported; the partition is recomputed"),
    "predefined_hooks": (
        True,
        "Hugging Face models inside smp.tensor_parallelism() are always split by shardkit's plans; keep one whole "
        "with smp.tensor_parallelism(enabled=False) around its creation instead",
    ),
}

#: ``placement_strategy`` may be a permutation of D (reduced data), P (pipeline), T (tensor), slowest first.
PERMUTATIONS = ("DPT", "DTP", "TDP", "PDT", "PTD", "TPD")


def read_config(config: Optional[Mapping[str, Any]]) -> tuple[dict[str, Any], str]:
    """The raw config and a name of its source for error messages (first of: ``config``, the environment)."""
    if config is not None:
        if not isinstance(config, Mapping):
            raise TypeError(f"smp.init(config) takes a dict of config keys, got {type(config).__name__}")
        return dict(config), "smp.init(config)"
    raw = os.environ.get(SAGEMAKER_ENV_VAR, "")
    if raw.strip():
        return _parse_json_object(raw, f"${SAGEMAKER_ENV_VAR}"), f"${SAGEMAKER_ENV_VAR}"
    raw = os.environ.get(CONFIG_ENV_VAR, "")
    if not raw.strip():
        return {}, "the defaults"
    source = f"${CONFIG_ENV_VAR}"
    if raw.lstrip().startswith("{"):
        return _parse_json_object(raw, source), source
    if not os.path.isfile(raw):
        raise ValueError(
            f"{source} must hold a JSON object of smp config keys or the path of a file holding one; {raw!r} is "
            "neither (no such file)"
        )
    try:
        with open(raw, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise ValueError(f"{source} names the file {raw!r}, which cannot be read: {exc}") from exc
    source = f"{source} (file {raw})"
    return _parse_json_object(text, source), source


def _parse_json_object(raw: str, source: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
        if isinstance(value, str):  # a launcher that JSON-encoded the JSON text once more
            value = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{source} must hold a JSON object of smp config keys, e.g. "
            f'{{"partitions": 2, "microbatches": 4, "ddp": true}}; it is not valid JSON ({exc}): {raw[:200]!r}'
        ) from exc
    if not isinstance(value, dict):
        raise ValueError(f"{source} must hold a JSON object of smp config keys, got {type(value).__name__}: {raw!r}")
    return value


def translate(values: Mapping[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split smp v1 keys into (shardkit config fields, keys accepted with no effect), converting string values.

    Raises one ``ValueError`` listing every unknown key and every unsupported feature asked for.
    """
    core: dict[str, Any] = {}
    accepted: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in _resolve_aliases(values, source).items():
        if key in CORE_KINDS:
            core[key] = coerce(key, value, CORE_KINDS[key], source)
        elif key in NO_EFFECT:
            accepted[key] = _no_effect(key, value, source)
        elif key in UNSUPPORTED:
            neutral, reason = UNSUPPORTED[key]
            kind = type(neutral) if neutral is not None else str
            given = coerce(key, value, kind, source) if value is not None else neutral  # None: smp's default
            if given != neutral:
                problems.append(f"  {key}={value!r}: {reason}")
        else:
            problems.append(f"  {key!r}: not an smp config key{_did_you_mean(key)}")
    if problems:
        raise ValueError(
            f"the smp config (from {source}) asks for what shardkit does not support:\n"
            + "\n".join(problems)
            + f"\nsupported keys: {', '.join(sorted(CORE_KINDS))}; accepted with no effect (see COMPATIBILITY.md): "
            + ", ".join(sorted(NO_EFFECT))
        )
    if "placement_strategy" in core:
        core["placement_strategy"] = _placement(core["placement_strategy"])
    return core, accepted


def _resolve_aliases(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``values`` with older spellings under their key; both spellings with different values is an error."""
    resolved = {key: value for key, value in values.items() if key not in ALIASES}
    for old, new in ALIASES.items():
        if old not in values:
            continue
        if new in values and values[new] != values[old]:
            raise ValueError(
                f"the smp config (from {source}) has {new}={values[new]!r} and {old}={values[old]!r}; {old} is an "
                f"older name of {new}: give one"
            )
        resolved[new] = values[old]
    return resolved


def _no_effect(key: str, value: Any, source: str) -> Any:
    """A no-effect key's value, typed (``None`` stands for smp's default) and, for a few, one of smp's values."""
    if value is None:
        return None
    kind = NO_EFFECT[key][0]
    value = _typed(key, coerce(key, value, kind, source), kind, source)
    if key in CHOICES and value not in CHOICES[key]:
        raise ValueError(
            f"smp config {key!r} from {source} must be one of {', '.join(map(repr, CHOICES[key]))}, got {value!r}"
        )
    if key in MINIMUM and value < MINIMUM[key]:
        raise ValueError(f"smp config {key!r} from {source} must be >= {MINIMUM[key]}, got {value}")
    return value


def _did_you_mean(key: str) -> str:
    known = [*CORE_KINDS, *NO_EFFECT, *UNSUPPORTED, *ALIASES]
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _placement(value: Any) -> Any:
    """``"DPT"``-style permutations in upper case (smp accepts any case); other values unchanged (checked later)."""
    if isinstance(value, str) and value.upper() in PERMUTATIONS:
        return value.upper()
    return value


def _typed(key: str, value: Any, kind: type, source: str) -> Any:
    """``value`` if it has ``kind`` (an int counts as a number); else a ``TypeError`` naming the key."""
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        raise TypeError(f"smp config {key!r} from {source} must be a {kind.__name__}, got {value!r}")
    return value


def coerce(key: str, value: Any, kind: type, source: str) -> Any:
    """``value`` as ``kind`` when it is a string spelling one (``"true"``, ``"4"``, ``"0.5"``); else unchanged
    (the config's own checks then name a wrong type)."""
    if not isinstance(value, str) or kind is str:
        return value
    text = value.strip()
    if kind is bool:
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise ValueError(f"smp config {key!r} from {source} must be true or false, got {value!r}")
    try:
        return int(text) if kind is int else float(text)
    except ValueError:
        raise ValueError(
            f"smp config {key!r} from {source} must be {'an int' if kind is int else 'a number'}, got {value!r}"
        ) from None
