"""The real-users contract: every fairscale name, argument and attribute that fairseq, VISSL, ClassyVision, mmf and
Lightning 1.x use exists in shardkit, and the ones they rely on most behave as fairscale's.

``fairscale_users.json`` beside this file is the output of ``tools/fairscale_users_scan.py`` (its header says how
it scans); regenerate it with::

    python tools/fairscale_users_scan.py --mirrors /work/.mirror > tests/compat/fairscale_users.json

Each entry is checked by kind: an import resolves under ``shardkit``; a call's keywords and positional count fit
the signature; an attribute fairscale defines exists on the class or on a built instance; one fairscale does not
define comes from torch's base class or falls through to the wrapped module. ``NOT_PROVIDED`` and ``MISREAD`` list
the exceptions with their reasons (COMPATIBILITY.md repeats them).
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from shardkit.distributed import DummyProcessGroup
from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.nn import ShardedDataParallel
from shardkit.optim import OSS

SCAN = json.loads((Path(__file__).parent / "fairscale_users.json").read_text())

#: Names shardkit does not provide, and why.
NOT_PROVIDED = {
    "fairscale.nn.Pipe": "fairscale's pipeline is not provided (COMPATIBILITY.md); fairseq imports it only for its "
    "pipeline-parallel transformer, behind an import guard",
}
#: Entries the static scan attributes to a fairscale object that, read in context, belong to another object.
MISREAD = {
    "fairscale.nn.data_parallel.ShardedDataParallel.register_comm_hook": "ClassyVision calls it on the torch DDP "
    "built in the other branch of the same method",
    "fairscale.optim.OSS._optimizer": "Lightning reads LightningOptimizer._optimizer; the scan sees an isinstance "
    "test against OSS in the same function",
}
GROUP = DummyProcessGroup(rank=0, size=1)


def _resolve(name: str) -> Any:
    """The shardkit object for a fairscale dotted name, found as ``from <parent> import <last>`` finds it: the
    parent by module path, the last name as the parent's attribute first (``fairscale.nn.wrap`` is the function
    ``wrap`` that ``fairscale.nn`` binds, not the submodule of that name), else as a submodule."""
    parent_name, _, last = name.rpartition(".")
    if not parent_name:
        return importlib.import_module("shardkit")
    parent = _resolve_path(parent_name)
    if hasattr(parent, last):
        return getattr(parent, last)
    return _resolve_path(name)


def _resolve_path(name: str) -> Any:
    """The shardkit object for a fairscale dotted name (module path, then attributes)."""
    parts = ["shardkit", *name.split(".")[1:]]
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


class UserModel(nn.Module):
    """A user's model with attributes of its own (what code reads through a wrapper)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.trunk = nn.Linear(2, 2)
        self.base_model = nn.Linear(2, 2)


def _instance(owner: str) -> Any:
    cls = owner.rsplit(".", 1)[-1]
    if cls == "FullyShardedDataParallel":
        return FSDP(UserModel(), process_group=GROUP)
    model = UserModel()
    oss = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, group=GROUP)
    if cls == "OSS":
        return oss
    if cls == "ShardedDataParallel":
        return ShardedDataParallel(model, oss)
    if cls == "SlowMoDistributedDataParallel":
        return None  # needs a process group of several nodes; its methods are checked on the class
    if cls == "FlattenParamsWrapper":
        return FSDP(UserModel(), process_group=GROUP).module
    return _resolve(owner)


def _accepts(fn: Callable[..., Any], keywords: list[str], positional: int) -> list[str]:
    """What of the call ``fn`` would not accept."""
    params = list(inspect.signature(fn).parameters.values())
    kinds = {p.kind for p in params}
    slots = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    problems = []
    if positional > len(slots) and inspect.Parameter.VAR_POSITIONAL not in kinds:
        problems.append(f"{positional} positional arguments (takes {len(slots)})")
    names = {p.name for p in params if p.kind != p.POSITIONAL_ONLY}
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        problems += [f"keyword {k!r}" for k in keywords if k not in names]
    return problems


def _check_call(entry: dict[str, Any]) -> list[str]:
    name = entry["name"]
    if name.endswith(".__init__"):
        return []  # a subclass's super().__init__(*args, **kwargs): the class call is checked
    target = _resolve(name)
    owner_name, _, attr = name.rpartition(".")
    owner = _resolve(owner_name)
    positional = entry["max_positional"]
    if isinstance(owner, type) and not isinstance(inspect.getattr_static(owner, attr), staticmethod):
        positional += 1  # called on an instance: self comes first
    return _accepts(target, entry["keywords"], positional)


def _check_attribute(entry: dict[str, Any]) -> list[str]:
    owner_name, _, attr = entry["name"].rpartition(".")
    instance = _instance(owner_name)
    cls = _resolve(owner_name)
    if instance is None:
        return [] if hasattr(cls, attr) else [f"{cls.__name__} has no {attr}"]
    if hasattr(instance, attr):
        if not entry.get("fairscale_defines", True) and isinstance(instance, nn.Module):
            wrapped = getattr(instance, "module", None)
            own = getattr(wrapped, attr, None) if wrapped is not None else None
            of_wrapper = attr in vars(instance) or hasattr(type(instance), attr)  # torch's, e.g. _modules
            if own is not None and not of_wrapper and getattr(instance, attr) is not own:
                return [f"{attr} does not fall through to the wrapped module"]
        return []
    return [f"{type(instance).__name__} has no {attr}"]


def _entry_id(entry: dict[str, Any]) -> str:
    return f"{entry['kind']}:{entry['name']}"


@pytest.mark.parametrize("entry", SCAN["uses"], ids=_entry_id)
def test_each_use_exists_with_fairscales_shape(entry: dict[str, Any]) -> None:
    name = entry["name"]
    if name in NOT_PROVIDED or name in MISREAD or any(name.startswith(f"{n}.") for n in NOT_PROVIDED):
        pytest.skip(NOT_PROVIDED.get(name) or MISREAD.get(name) or "not provided")
    kind = entry["kind"]
    if kind == "import":
        assert _resolve(name) is not None
    elif kind == "subclass":
        cls = _resolve(name)
        assert isinstance(cls, type) and type("UserSubclass", (cls,), {})
    elif kind == "call":
        assert _check_call(entry) == [], entry["where"]
    else:
        assert _check_attribute(entry) == [], entry["where"]


def test_scan_covers_the_five_code_bases() -> None:
    sources = SCAN["sources"]
    assert {"fairseq", "vissl", "ClassyVision", "mmf", "lightning-1.9.5"} <= set(sources)
    assert all(s["files"] > 0 for label, s in sources.items() if not label.startswith("fairscale"))
    kinds = {e["kind"] for e in SCAN["uses"]}
    assert kinds == {"import", "call", "attribute", "subclass"}


# ------------------------------------------------------------------ fairscale's meaning, where users rely on it
def test_auto_wrap_bn_with_vissls_arguments() -> None:
    from shardkit.nn.data_parallel import auto_wrap_bn

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
    wrapped = auto_wrap_bn(model, single_rank_pg=False, process_group=GROUP)
    units = [m for m in wrapped.modules() if isinstance(m, FSDP)]
    assert [type(u.wrapped_module).__name__ for u in units] == ["BatchNorm1d"]
    assert units[0].process_group is GROUP and not units[0].mixed_precision  # BN kept in full precision


def test_wrap_policies_are_called_with_three_positional_arguments() -> None:
    from shardkit.nn import auto_wrap, enable_wrap

    calls: list[tuple[str, bool, int]] = []

    def policy(module: nn.Module, recurse: bool, unwrapped_params: int, /) -> bool:  # positional only
        calls.append((type(module).__name__, recurse, unwrapped_params))
        return recurse or isinstance(module, nn.Linear)

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with enable_wrap(wrapper_cls=FSDP, process_group=GROUP):
        wrapped = auto_wrap(model, auto_wrap_policy=policy)
    assert calls and all(isinstance(n, int) for _, _, n in calls)
    assert [type(m.wrapped_module).__name__ for m in wrapped.modules() if isinstance(m, FSDP)] == ["Linear"] * 2


def test_force_leaf_modules_is_read_and_honoured() -> None:
    from shardkit.nn import auto_wrap, default_auto_wrap_policy, enable_wrap

    assert nn.MultiheadAttention in default_auto_wrap_policy.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
    model = nn.Sequential(nn.MultiheadAttention(8, 2), nn.Linear(8, 8))
    with enable_wrap(wrapper_cls=FSDP, process_group=GROUP):
        wrapped = auto_wrap(model, auto_wrap_policy=_min_params(1))
    attention = [m for m in wrapped.modules() if isinstance(m, nn.MultiheadAttention)]
    assert len(attention) == 1 and not any(isinstance(m, FSDP) for m in attention[0].modules())


def _min_params(n: int) -> Callable[..., bool]:
    from shardkit.nn import default_auto_wrap_policy

    def policy(module: nn.Module, recurse: bool, unwrapped_params: int) -> bool:
        return bool(default_auto_wrap_policy(module, recurse, unwrapped_params, min_num_params=n))

    return policy


def test_is_root_and_reset_lazy_init_as_vissl_uses_them() -> None:
    inner = FSDP(nn.Linear(4, 4), process_group=GROUP)
    assert inner._is_root is None
    inner(torch.ones(1, 4)).sum().backward()
    assert inner._is_root is True  # ran alone first: it became a root
    # VISSL forgets the decision before putting the unit under a new root, then trains the bigger model.
    inner._is_root = None  # type: ignore[assignment]
    outer = FSDP(nn.Sequential(inner, nn.Linear(4, 1)), process_group=GROUP)
    outer(torch.ones(1, 4)).sum().backward()
    assert outer._is_root is True and inner._is_root is False
    for unit in (outer, inner):
        unit._reset_lazy_init()
    assert outer._is_root is None and inner._is_root is None
    outer(torch.ones(1, 4)).sum().backward()
    assert outer._is_root is True and inner._is_root is False
    with pytest.raises(ValueError, match="only be set to None"):
        inner._is_root = True  # type: ignore[assignment]


def test_fsdp_wrapped_module_and_flatten_params_wrapper_as_vissls_hooks_read_them() -> None:
    from shardkit.nn.misc import FlattenParamsWrapper
    from shardkit.nn.misc.flatten_params_wrapper import FlatParameter

    bn = nn.BatchNorm1d(4)
    unit = FSDP(bn, process_group=GROUP)
    wrapped = unit._fsdp_wrapped_module
    assert isinstance(wrapped, FlattenParamsWrapper) and wrapped._fpw_module is bn
    assert isinstance(wrapped, nn.BatchNorm1d)  # the user's class, as the module itself answered before
    assert all(isinstance(p, FlatParameter) for p in unit.parameters())
    assert not isinstance(nn.Parameter(torch.ones(1)), FlatParameter)
    unflattened = FSDP(nn.Linear(2, 2), process_group=GROUP, flatten_parameters=False)
    assert not isinstance(unflattened.module, FlattenParamsWrapper)
    with pytest.raises(NotImplementedError, match="FullyShardedDataParallel"):
        FlattenParamsWrapper(bn, param_list=list(bn.parameters()))
