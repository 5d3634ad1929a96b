"""Private torch names are reached only through the per-package import points, and each resolves on this torch.

A torch release that moves one of them fails here, naming it, instead of somewhere inside a strategy; a new reach
written outside an import point fails the scan below.
"""

from __future__ import annotations

import ast
import importlib
import io
import pickle
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.futures import Future
from torch.nn.attention import SDPBackend

from shardkit.testing import run_distributed
from shardkit.utils.torch_compat import PRIVATE_APIS

SRC = Path(__file__).resolve().parents[2] / "src"

#: The one module per package allowed to reach private torch names.
IMPORT_POINTS = (
    "shardkit.utils._torch_private",
    "shardkit.distributed._torch_private",
    "shardkit.nn._torch_private",
    "shardkit.checkpoint._torch_private",
    "shardkit.modelparallel._torch_private",
    "shardkit.plan._torch_private",
    "shardkit.bench._torch_private",
)

#: Private attributes of torch objects that are reached on an instance (no ``torch.`` prefix to see): the scan
#: refuses them on any receiver but ``self`` outside the import points, and in ``getattr``-style strings.
INSTANCE_PRIVATES = frozenset(
    {
        "_base",
        "_execution_engine",
        "_get_backend",
        "_get_default_store",
        "_local_tensor",
        "_make_wrapper_subclass",
        "_metadata",
        "_opt_called",
        "_optimizer_load_state_dict_post_hooks",
        "_optimizer_state_dict_post_hooks",
        "_optimizer_state_dict_pre_hooks",
        "_overloadpacket",
        "_per_optimizer_states",
        "_timeout",
    }
)

#: ``nn.Module``'s own bookkeeping, which subclasses and wrappers read as torch's modules do (arch_check's list).
MODULE_INTERNALS = frozenset(
    {
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_version",
        "_load_from_state_dict",
        "_save_to_state_dict",
        "_register_load_state_dict_pre_hook",
        "_register_state_dict_hook",
        "_apply",
        "_call_impl",
        "_get_name",
        "_named_members",
    }
)


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


class _Scan(ast.NodeVisitor):
    """Every reach of a private torch name in one module, as ``(line, dotted name)``.

    Names bound to torch (``import torch``, ``import torch.distributed as dist``, ``from torch import nn``,
    ``aten = torch.ops.aten``) are followed, so ``dist.distributed_c10d._get_default_store`` reads as
    ``torch.distributed.distributed_c10d._get_default_store``. Receivers that are not torch names are caught by
    :data:`INSTANCE_PRIVATES`, and classes derived from torch's by the ``self._x`` they read without setting.
    """

    def __init__(self, tree: ast.Module) -> None:
        self.aliases: dict[str, str] = {}
        self.found: list[tuple[int, str]] = []
        self.parents: dict[ast.AST, ast.AST] = {}
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent
        self._bind_aliases(tree)
        self.visit(tree)
        self._scan_torch_subclasses(tree)

    def _bind_aliases(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "torch" or a.name.startswith("torch."):
                        self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("torch"):
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):  # aten = torch.ops.aten
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                dotted = self.dotted(node.value)
                if dotted is not None:
                    self.aliases[node.targets[0].id] = dotted

    def dotted(self, node: ast.AST) -> Optional[str]:
        """``node`` as a dotted torch name, or None when it is not rooted at one."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in self.aliases:
            return ".".join([self.aliases[node.id], *reversed(parts)])
        return None

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name.startswith("torch.") and any(_private(p) for p in a.name.split(".")):
                self.found.append((node.lineno, a.name))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level == 0 and (module == "torch" or module.startswith("torch.")):
            for a in node.names:
                if any(_private(p) for p in module.split(".")) or _private(a.name):
                    self.found.append((node.lineno, f"{module}.{a.name}"))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        outer = self.parents.get(node)
        if not (isinstance(outer, ast.Attribute) and outer.value is node):  # the whole chain, once
            dotted = self.dotted(node)
            if dotted is not None and any(_private(p) for p in dotted.split(".")[1:]):
                self.found.append((node.lineno, dotted))
        receiver = node.value
        is_self = isinstance(receiver, ast.Name) and receiver.id == "self"
        if node.attr in INSTANCE_PRIVATES and not is_self and self.dotted(receiver) is None:
            self.found.append((node.lineno, f"<instance>.{node.attr}"))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = node.func.id if isinstance(node.func, ast.Name) else ""
        if name in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2:
            attr = node.args[1]
            if isinstance(attr, ast.Constant) and attr.value in INSTANCE_PRIVATES:
                self.found.append((node.lineno, f"{name}(<instance>, {attr.value!r})"))
        self.generic_visit(node)

    def _scan_torch_subclasses(self, tree: ast.Module) -> None:
        """``self._x`` read in a class derived (in this module) from a torch class that neither it nor its local
        bases set: a private attribute inherited from torch."""
        classes = {c.name: c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)}

        def torch_based(c: ast.ClassDef, seen: frozenset[str] = frozenset()) -> bool:
            for base in c.bases:
                if self.dotted(base) is not None:
                    return True
                name = base.id if isinstance(base, ast.Name) else ""
                if name in classes and name not in seen and torch_based(classes[name], seen | {c.name}):
                    return True
            return False

        def own(c: ast.ClassDef) -> set[str]:
            names: set[str] = set()
            for n in ast.walk(c):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(n.name)
                elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                    if isinstance(n.value, ast.Name) and n.value.id == "self":
                        names.add(n.attr)
                elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                    targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                    names.update(t.id for t in targets if isinstance(t, ast.Name))
            for base in c.bases:
                if isinstance(base, ast.Name) and base.id in classes:
                    names |= own(classes[base.id])
            return names

        for c in classes.values():
            if not torch_based(c):
                continue
            mine = own(c)
            for n in ast.walk(c):
                if (
                    isinstance(n, ast.Attribute)
                    and isinstance(n.value, ast.Name)
                    and n.value.id == "self"
                    and _private(n.attr)
                    and n.attr not in mine
                    and n.attr not in MODULE_INTERNALS
                ):
                    self.found.append((n.lineno, f"{c.name}: self.{n.attr} (inherited from torch)"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _reaches(path: Path) -> list[tuple[int, str]]:
    return _Scan(ast.parse(path.read_text(), filename=str(path))).found


def test_no_module_outside_the_import_points_reaches_a_private_torch_name() -> None:
    offenders = []
    for path in sorted((SRC / "shardkit").rglob("*.py")):
        if _module_name(path) in IMPORT_POINTS:
            continue
        offenders += [f"{path.relative_to(SRC)}:{line} {name}" for line, name in _reaches(path)]
    assert not offenders, "import these from the package's _torch_private module instead:\n" + "\n".join(offenders)


def test_the_scan_sees_each_kind_of_reach() -> None:
    """The scanner is what keeps the rule: it must flag each way code reaches a private torch name."""
    source = """
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map
from torch.nn.modules.module import _IncompatibleKeys
aten = torch.ops.aten
torch._C._current_graph_task_id()
dist.distributed_c10d._get_default_store()
nn.modules.batchnorm._BatchNorm
aten._scaled_dot_product_efficient_attention
t._base
getattr(sd, "_metadata", None)
class Scaler(torch.amp.GradScaler):
    def f(self):
        self._own = 1
        return self._scale, self._own, self._parameters
torch.ops.aten.add
"""
    found = [name for _, name in _Scan(ast.parse(source)).found]
    assert found == [
        "torch.utils._pytree.tree_map",
        "torch.nn.modules.module._IncompatibleKeys",
        "torch._C._current_graph_task_id",
        "torch.distributed.distributed_c10d._get_default_store",
        "torch.nn.modules.batchnorm._BatchNorm",
        "torch.ops.aten._scaled_dot_product_efficient_attention",
        "<instance>._base",
        "getattr(<instance>, '_metadata')",
        "Scaler: self._scale (inherited from torch)",
    ]


def test_every_name_an_import_point_reaches_is_listed_for_gpu_check() -> None:
    """``PRIVATE_APIS`` (what ``make gpu-check`` and the matrix resolve) lists every dotted name the import points
    reach, so a name added to an import point is checked on each release too."""
    listed = {api.name for api in PRIVATE_APIS}
    unlisted = []
    for module in IMPORT_POINTS:
        path = SRC / Path(*module.split(".")).with_suffix(".py")
        for line, name in _reaches(path):
            if name.startswith("torch") and name not in listed:
                unlisted.append(f"{module}:{line} {name}")
    assert not unlisted, "add these to shardkit.utils.torch_compat.PRIVATE_APIS:\n" + "\n".join(unlisted)


@pytest.mark.parametrize("module", IMPORT_POINTS)
def test_each_import_point_imports_and_exports_what_it_names(module: str) -> None:
    mod = importlib.import_module(module)
    assert mod.__all__, module
    for name in mod.__all__:
        assert getattr(mod, name, None) is not None, f"{module}.{name} on torch {torch.__version__}"


def test_utils_private_names_behave_as_shardkit_expects() -> None:
    from shardkit.utils import _torch_private as P

    assert P.current_graph_task_id() == -1  # outside a backward pass
    seen: list[int] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            seen.append(P.current_graph_task_id())
            P.queue_autograd_callback(lambda: seen.append(-2))
            return grad * 2

    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert len(seen) == 2 and seen[0] != -1 and seen[1] == -2  # inside backward, then the end-of-backward callback

    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    assert P.scaler_scale(scaler) is None
    P.set_scaler_device(scaler, "cpu")
    scaler.scale(torch.ones(1))
    scale = P.scaler_scale(scaler)
    assert scale is not None and float(scale) == 4.0
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    param.grad = torch.full((2,), 4.0)
    scaler.unscale_(optimizer)
    assert set(P.scaler_optimizer_state(scaler, optimizer)["found_inf_per_device"]) == {torch.device("cpu")}

    calls: list[str] = []
    optimizer.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    optimizer.register_state_dict_post_hook(lambda o, sd: calls.append("post"))
    optimizer.register_load_state_dict_post_hook(lambda o: calls.append("load"))
    [pre] = P.optimizer_state_dict_pre_hooks(optimizer)
    [post] = P.optimizer_state_dict_post_hooks(optimizer)
    [load] = P.optimizer_load_state_dict_post_hooks(optimizer)
    pre(optimizer)
    post(optimizer, {})
    load(optimizer)
    assert calls == ["pre", "post", "load"]

    stack_outside = list(P.current_dispatch_mode_stack())

    class Mode(P.TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    with Mode():
        assert P.is_in_torch_dispatch_mode()
        assert len(P.current_dispatch_mode_stack()) == len(stack_outside) + 1
    assert P.dtensor_local_tensor(torch.ones(1)) is None
    leaves, spec = P.tree_flatten({"a": [1, 2]})
    assert P.tree_unflatten(leaves, spec) == {"a": [1, 2]} and isinstance(spec, P.TreeSpec)


def test_nn_private_names_behave_as_shardkit_expects() -> None:
    from shardkit.nn import _torch_private as P

    state = nn.Linear(2, 2).state_dict()
    metadata = P.state_dict_metadata(state)
    assert metadata is not None and metadata[""]["version"] == 1  # torch still records module versions there
    plain: Any = type("Plain", (dict,), {})()
    assert P.state_dict_metadata(plain) is None
    assert P.attach_state_dict_metadata(plain, {"x": 1}) == {"x": 1} and P.state_dict_metadata(plain) == {"x": 1}
    base = torch.ones(4)
    assert P.view_base(base.view(2, 2)) is base and P.view_base(base) is None
    assert isinstance(nn.BatchNorm2d(2), P.BatchNormBase) and isinstance(nn.SyncBatchNorm(2), P.BatchNormBase)
    assert nn.Linear(1, 1).load_state_dict(nn.Linear(1, 1).state_dict()) == P.IncompatibleKeys([], [])


def test_plan_private_names_behave_as_shardkit_expects() -> None:
    from shardkit.plan import _torch_private as P

    q = torch.randn(1, 2, 4, 8)
    choice = SDPBackend(P.fused_sdp_choice(q, q, q, None, 0.0, False, scale=None, enable_gqa=False))
    assert isinstance(choice, SDPBackend)
    flash = P.flash_attention_for_cpu(q, q, q, 0.0, False, attn_mask=None, scale=None)[0]
    reference = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    torch.testing.assert_close(flash, reference)
    meta = q.to("meta")
    assert P.efficient_attention(meta, meta, meta, None, False, 0.0, False, scale=None)[0].shape == q.shape
    future: Future[Any] = Future()
    future.set_result([torch.ones(1)])
    assert P.create_work_from_future(future).wait()
    with P.disable_current_modes():
        pass
    assert type(P.mem_tracker()).__name__ == "MemTracker"


def test_checkpoint_private_globals_resolve() -> None:
    """Each private global a DCP index may name still exists where the allow-list lets pickle import it from."""
    from shardkit.checkpoint._torch_private import DCP_INDEX_PRIVATE_GLOBALS

    for module, names in DCP_INDEX_PRIVATE_GLOBALS.items():
        for name in names:
            data = pickle.dumps(getattr(importlib.import_module(module), name))
            assert pickle.Unpickler(io.BytesIO(data)).load() is not None


def _distributed_private_names(rank: int, world_size: int) -> tuple[bool, Any]:
    from shardkit.distributed import _torch_private as P

    return P.default_store() is not None, P.backend_timeout(dist.group.WORLD, "cpu")


def test_distributed_private_names_behave_as_shardkit_expects() -> None:
    [(has_store, timeout)] = run_distributed(_distributed_private_names, 1, timeout_s=60)
    assert has_store and isinstance(timeout, timedelta)


def test_modelparallel_foreach_kernels_compute() -> None:
    from shardkit.modelparallel import _torch_private as P

    xs = [torch.ones(2), torch.full((3,), 2.0)]
    assert [float(n) for n in P.foreach_norm(xs)] == pytest.approx([2**0.5, (12.0) ** 0.5])
    P.foreach_mul_(xs, 3.0)
    assert [x.tolist() for x in xs] == [[3.0, 3.0], [6.0, 6.0, 6.0]]
