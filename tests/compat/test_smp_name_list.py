"""COMPATIBILITY.md's list of smp v1 public names matches ``dir(smp)`` both ways: every name listed as present
exists, every name listed as missing does not, and every public name of the module is listed; every public name of
smp v1's three API pages is listed, and every test file the table names exists."""

from __future__ import annotations

import inspect
import re
import types
from pathlib import Path
from typing import Any

import pytest

import shardkit.modelparallel as smp
from shardkit.modelparallel.tensor_parallel import TensorParallelismNotSupported

_ROW = re.compile(r"^\| `smp\.([A-Za-z_][A-Za-z0-9_.]*)` \| (same|differs|refuses|missing|added) \|")
STATUSES = {"same", "differs", "refuses", "missing", "added"}
#: A name another change of issue 34 is building: it may or may not exist yet.
TESTS = Path(__file__).resolve().parents[1]

#: Every public name of smp v1's three API pages (aws/sagemaker-python-sdk doc/api/training/smp_versions/latest/,
#: smd_model_parallel_common_api.rst, smd_model_parallel_pytorch.rst, smd_model_parallel_pytorch_tensor_parallel.rst,
#: at their last version, bd4489a7e), as ``smp.<name>``.
PAGE_NAMES = (
    # common API page
    "init", "step", "StepOutput", "StepOutput.outputs", "StepOutput.reduce_mean", "StepOutput.reduce_sum",
    "StepOutput.concat", "StepOutput.stack", "StepOutput.merge", "StepOutput.accumulate", "rank", "size",
    "get_world_process_group", "local_rank", "local_size", "get_mp_group", "get_dp_group", "tp_rank", "tp_size",
    "get_tp_process_group", "pp_rank", "pp_size", "get_pp_process_group", "rdp_rank", "rdp_size",
    "get_rdp_process_group", "mp_rank", "mp_size", "get_mp_process_group", "dp_rank", "dp_size",
    "get_dp_process_group", "CommGroup", "CommGroup.WORLD", "CommGroup.MP_GROUP", "CommGroup.DP_GROUP",
    "CommGroup.PP_GROUP", "CommGroup.RDP_GROUP", "CommGroup.TP_GROUP", "RankType", "RankType.WORLD_RANK",
    "RankType.MP_RANK", "RankType.DP_RANK", "WORLD", "MP_GROUP", "DP_GROUP", "broadcast", "send", "recv_from",
    "allgather", "barrier", "dp_barrier", "mp_barrier",
    # PyTorch API page
    "DistributedModel", "DistributedModel.backward", "DistributedModel.local_buffers",
    "DistributedModel.local_named_buffers", "DistributedModel.local_parameters",
    "DistributedModel.local_named_parameters", "DistributedModel.local_modules", "DistributedModel.local_named_modules",
    "DistributedModel.local_state_dict", "DistributedModel.state_dict", "DistributedModel.load_state_dict",
    "DistributedModel.register_post_partition_hook", "DistributedModel.cpu", "DistributedModel.join",
    "DistributedModel.register_comm_hook", "DistributedOptimizer", "DistributedOptimizer.state_dict",
    "DistributedOptimizer.load_state_dict", "DistributedOptimizer.local_state_dict", "nn.FlashAttentionLayer",
    "model_creation", "partition", "amp.GradScaler", "delay_param_initialization", "is_initialized", "is_tracing",
    "nn.FusedLayerNorm", "optimizers.FusedNovoGrad", "optimizers.FusedLamb", "save", "load", "save_checkpoint",
    "resume_from_checkpoint",
    # tensor-parallel page
    "tp_register", "tp_register_with_module", "nn.DistributedModule", "nn.DistributedLinear",
    "nn.DistributedTransformerLMHead", "nn.DistributedTransformer", "nn.DistributedTransformerLayer",
    "nn.DistributedAttentionLayer", "nn.DistributedTransformerOutputLayer", "nn.DistributedEmbedding", "nn.Transformer",
    "set_tensor_parallelism", "tensor_parallelism", "patches.checkpoint.checkpoint",
    "patches.checkpoint.checkpoint_sequential", "set_activation_checkpointing",
)  # fmt: skip


def _listed() -> dict[str, str]:
    text = (Path(__file__).resolve().parents[2] / "COMPATIBILITY.md").read_text()
    section = text.split("## smp (`import shardkit.modelparallel as smp`)", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = _ROW.match(line)
        if match:
            assert match.group(1) not in rows, f"smp.{match.group(1)} is listed twice"
            rows[match.group(1)] = match.group(2)
    return rows


def _lookup(dotted: str) -> Any:
    """``smp.<dotted>``; an attribute its class sets on each instance in ``__init__`` counts as existing."""
    obj: Any = smp
    for part in dotted.split("."):
        if isinstance(obj, type) and not hasattr(obj, part) and f"self.{part} = " in inspect.getsource(obj.__init__):
            return None
        obj = getattr(obj, part)
    return obj


def _table_rows() -> list[list[str]]:
    """The cells of each row of the "Every smp v1 public name" table."""
    text = (TESTS.parent / "COMPATIBILITY.md").read_text()
    table = text.split("### Every smp v1 public name", 1)[1].split("\n### ", 1)[0]
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")] for line in table.splitlines() if _ROW.match(line)
    ]


def _public_names() -> set[str]:
    """Public names of the module: not private, not one of its own implementation submodules."""
    names = set()
    for name in dir(smp):
        if name.startswith("_"):
            continue
        value = getattr(smp, name)
        if isinstance(value, types.ModuleType) and name not in smp.__all__:
            continue  # e.g. smp.state, smp.comm: where the names live, not names scripts use
        names.add(name)
    return names | {"__version__"}


def test_every_listed_name_is_as_listed() -> None:
    rows = _listed()
    assert len(rows) > 60, "the table of smp names was not found"
    wrong = []
    for name, status in rows.items():
        try:
            _lookup(name)
            exists = True
        except AttributeError:
            exists = False
        if exists == (status == "missing"):
            wrong.append(f"smp.{name} is listed as {status} but {'exists' if exists else 'does not exist'}")
    assert not wrong, "\n".join(wrong)


def test_every_public_name_is_listed() -> None:
    listed = _listed()
    unlisted = sorted(_public_names() - set(listed))
    assert not unlisted, f"public smp names missing from COMPATIBILITY.md's smp table: {unlisted}"
    assert set(smp.__all__) <= set(listed)


def test_refusing_names_raise_the_tensor_parallelism_error() -> None:
    refusing = [name for name, status in _listed().items() if status == "refuses"]
    for name in refusing:
        with pytest.raises(TensorParallelismNotSupported, match="not built in shardkit yet"):
            _lookup(name)(16, 16)


def test_every_name_of_smps_three_pages_is_listed() -> None:
    unlisted = [f"smp.{name}" for name in PAGE_NAMES if name not in _listed()]
    assert not unlisted, f"names of smp's API pages missing from COMPATIBILITY.md's smp tables: {unlisted}"


def test_every_built_name_names_test_files_that_exist() -> None:
    rows = _table_rows()
    assert len(rows) > 100, "the table of every smp v1 public name was not found"
    wrong = []
    for cells in rows:
        name, status, tested = cells[0], cells[1], cells[-1] if len(cells) == 4 else ""
        files = re.findall(r"`([^`]+\.py)`", tested)
        if status == "missing" and not files:
            continue
        if not files:
            wrong.append(f"{name} ({status}) names no test file")
        wrong += [f"{name}: tests/{f} does not exist" for f in files if not (TESTS / f).is_file()]
    assert not wrong, "\n".join(wrong)
