"""``shardkit checkpoint export --hf``: a checkpoint of a transformers model as a ``save_pretrained`` folder.

The folder holds ``config.json`` (and ``generation_config.json`` for generative models) and the weights as
safetensors shards named the way ``save_pretrained`` names them, so ``AutoModelForCausalLM.from_pretrained(folder)``
(or the task class the config names) loads it. The architecture comes from a ``config.json`` or from a model type
with overrides (``gpt2`` with ``n_layer=2,n_embd=64``); it is built on the meta device only to learn the names and
shapes it expects, so no weights are allocated or downloaded. Every checkpoint tensor must be one the model
expects, with its shape; a weight tied to another (``lm_head.weight`` to the embedding) is written once, under the
first name, as ``save_pretrained`` does.

Example::

    config = hf_config(model_type="gpt2", overrides="n_layer=2,n_embd=64")
    export_hf("runs/exp1/step_00000100", "export/gpt2-small", config)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

import torch

from shardkit.checkpoint.errors import IncompatibleCheckpointError
from shardkit.checkpoint.tools.export import DEFAULT_MAX_SHARD_BYTES, write_shards
from shardkit.checkpoint.tools.store import CheckpointView


def parse_overrides(text: Optional[str]) -> dict[str, Any]:
    """``"n_layer=2,n_embd=64,act=gelu"`` -> ``{"n_layer": 2, "n_embd": 64, "act": "gelu"}`` (JSON values, else
    strings)."""
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"config override {item!r} is not KEY=VALUE; write e.g. n_layer=2,n_embd=64")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value.strip()
    return out


def hf_config(
    config_path: Optional[Union[str, Path]] = None, model_type: Optional[str] = None, overrides: Optional[str] = None
) -> Any:
    """A ``transformers`` config from a ``config.json`` path or a model type, with ``overrides`` applied."""
    from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

    if (config_path is None) == (model_type is None):
        raise ValueError("give exactly one of --hf-config PATH (a config.json) or --hf-model-type TYPE")
    extra = parse_overrides(overrides)
    if config_path is not None:
        path = Path(config_path)
        if not path.is_file():
            raise ValueError(f"--hf-config {path} is not a file; pass the path of a config.json")
        obj = json.loads(path.read_text())
        kind = obj.get("model_type")
        if not kind or kind not in CONFIG_MAPPING:
            raise ValueError(
                f"{path} has no model_type this transformers knows ({kind!r}); pass a transformers config.json"
            )
        config: PretrainedConfig = CONFIG_MAPPING[kind].from_dict({**obj, **extra})
        return config
    assert model_type is not None
    try:
        return AutoConfig.for_model(model_type, **extra)
    except ValueError as err:
        raise ValueError(f"--hf-model-type {model_type!r}: {err}") from None


def _model_class(config: Any) -> Any:
    """The class ``from_pretrained`` users will load: the config's first listed architecture, else a causal LM."""
    import transformers

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM


def expected_weights(config: Any) -> tuple[dict[str, tuple[int, ...]], dict[str, str], Any]:
    """Names and shapes the model of ``config`` saves, the tied names (alias -> name kept), and its class.

    The model is built on the meta device: nothing is allocated or downloaded.
    """
    cls = _model_class(config)
    with torch.device("meta"):
        model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    shapes: dict[str, tuple[int, ...]] = {}
    tied: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in first_name:
            tied[name] = first_name[key]
            continue
        first_name[key] = name
        shapes[name] = tuple(tensor.shape)
    return shapes, tied, type(model)


def export_hf(
    directory: Union[str, Path],
    out: Union[str, Path],
    config: Any,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: Optional[torch.dtype] = None,
) -> list[Path]:
    """Write the checkpoint at ``directory`` as a ``save_pretrained`` folder ``out`` for ``config``'s model.

    Refuses (IncompatibleCheckpointError, nothing written) when a checkpoint tensor is not one the model
    expects, has another shape, or when a weight the model needs is missing.
    """
    view = CheckpointView.open(directory)
    shapes, tied, model_cls = expected_weights(config)
    entries = view.model_entries()
    have = {e.name: e for e in entries}
    unexpected = [n for n in have if n not in shapes and n not in tied]
    missing = [n for n in shapes if n not in have and not any(t == n and a in have for a, t in tied.items())]
    wrong = [
        f"{n}: checkpoint {have[n].shape}, model {shapes[n]}"
        for n in have
        if n in shapes and have[n].shape != shapes[n]
    ]
    if unexpected or missing or wrong:
        problems = []
        if unexpected:
            problems.append(f"not in the model: {unexpected[:5]}")
        if missing:
            problems.append(f"missing from the checkpoint: {missing[:5]}")
        problems += wrong[:5]
        raise IncompatibleCheckpointError(
            f"{view.directory} does not fit {model_cls.__name__} built from this config ({'; '.join(problems)}); "
            "pass the config the model was trained with (--hf-config or --hf-model-type with its overrides)"
        )
    # A tied pair stored under the alias only (the kept name absent) is written under the kept name.
    names = {a: t for a, t in tied.items() if a in have and t not in have}
    chosen = [e for e in entries if e.name in shapes or e.name in names]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config.architectures = [model_cls.__name__]
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(out)
    files = write_shards(view, chosen, out, names=names, max_shard_bytes=max_shard_bytes, dtype=dtype)
    if getattr(model_cls, "can_generate", lambda: False)():
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(config).save_pretrained(out)
    return [out / "config.json", *files]
