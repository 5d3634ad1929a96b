"""Sphinx extension: the API reference's pages, generated from :mod:`api_registry` at every build.

Each registered package gets one page (``docs/api/generated/<module>.rst``, not committed) with its docstring and
an autodoc entry per public name, followed by the fairscale and smp names that object answers to. An object
exported by several packages is described once, on the first registered package's page, and linked from the
others; a reference to it under the module that defines it (as type hints give it) resolves to that description.
Problems found by ``api_registry.check()`` are build warnings, so ``-W`` fails on them.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import api_registry as registry
from docutils import nodes
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.util import logging

LOGGER = logging.getLogger(__name__)
#: The build's Reference (not on the environment, which Sphinx pickles: it holds modules).
_STATE: Dict[str, Reference] = {}
GENERATED = Path(__file__).resolve().parents[1] / "api" / "generated"


def _role(value: Any) -> str:
    if inspect.isclass(value):
        return "class"
    if inspect.ismodule(value):
        return "mod"
    if callable(value):
        return "func"
    return "data"


def _directive(role: str) -> str:
    return {"class": "autoclass", "func": "autofunction", "data": "autodata"}[role]


class Reference:
    """Where each public object is described, and the names it answers to elsewhere."""

    def __init__(self) -> None:
        self.canonical: Dict[int, str] = {}
        self.defined_as: Dict[str, str] = {}
        self.modules: Dict[str, Any] = {}
        modules = {package.module for package in registry.PACKAGES}
        for package in sorted(registry.PACKAGES, key=lambda p: p.face):  # the faces link to the core pages
            module = registry.import_registered(package)
            if module is None:
                continue
            self.modules[package.module] = module
            for name in registry.public_names(module):
                value = getattr(module, name)
                if inspect.ismodule(value) or id(value) in self.canonical or f"{package.module}.{name}" in modules:
                    continue  # (shardkit.nn's function ``wrap`` is described as shardkit.nn.wrap.wrap)
                self.canonical[id(value)] = f"{package.module}.{name}"
                real = f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
                self.defined_as.setdefault(real, f"{package.module}.{name}")
        short: Dict[str, List[str]] = {}
        for canonical in self.canonical.values():
            short.setdefault(canonical.rsplit(".", 1)[1], []).append(canonical)
        #: A short name (as a type hint shows it) that only one described object has.
        self.by_short_name = {name: found[0] for name, found in short.items() if len(found) == 1}
        self.fairscale = registry.fairscale_aliases()
        self.smp = registry.smp_statuses()

    def smp_line(self, module: str, name: str) -> Optional[str]:
        if not module.startswith("shardkit.modelparallel"):
            return None
        dotted = (module[len("shardkit.modelparallel") :] + "." + name).lstrip(".")
        status = self.smp.get(dotted)
        if status is None:
            return None
        if status == "added":
            return f"**smp:** a shardkit addition (``smp.{dotted}`` does not exist in smp v1)."
        return f"**smp:** ``{registry.SMP_MODULE}.{dotted}`` ({status}; see :doc:`/migration/smp`)."

    def mapping_lines(self, module: str, name: str, value: Any) -> List[str]:
        lines = []
        fairscale = self.fairscale.get(id(value))
        if fairscale:
            listed = ", ".join(f"``{alias}``" for alias in sorted(set(fairscale)))
            lines.append(f"**fairscale:** {listed} (see :doc:`/migration/fairscale`).")
        smp = self.smp_line(module, name)
        if smp:
            lines.append(smp)
        return lines


def _entry(ref: Reference, module: str, name: str, value: Any) -> List[str]:
    role = _role(value)
    if role == "mod":
        target = value.__name__
        if target in ref.modules:
            return [f"* ``{name}``: the module :mod:`{target}`", ""]
        return [f"* ``{name}``: the module ``{target}``", ""]
    canonical = ref.canonical[id(value)]
    if canonical != f"{module}.{name}":
        return [f"* ``{name}``: :py:{role}:`{canonical}`", ""]
    lines = [f".. {_directive(role)}:: {canonical}"]
    if role == "class":
        lines += ["   :members:", "   :show-inheritance:"]
    lines.append("")
    lines += [f"   {line}" for line in ref.mapping_lines(module, name, value)]
    return [*lines, ""]


def _page(ref: Reference, package: registry.ApiPackage) -> str:
    module = ref.modules[package.module]
    title = f"``{package.module}``"
    lines = [title, "=" * len(title), "", f".. automodule:: {package.module}", ""]
    if package.face:
        lines += [
            f".. note:: This module is fairscale's path ``{package.summary}``: it only re-exports, and each name "
            "links to where it is described.",
            "",
        ]
    entries = [(name, getattr(module, name)) for name in registry.public_names(module)]
    described = [(n, v) for n, v in entries if ref.canonical.get(id(v)) == f"{package.module}.{n}"]
    linked = [(n, v) for n, v in entries if (n, v) not in described]
    for name, value in described:
        lines += _entry(ref, package.module, name, value)
    if linked:
        lines += [".. rubric:: Also exported here", ""]
        for name, value in linked:
            lines += _entry(ref, package.module, name, value)
    return "\n".join(lines) + "\n"


def _index(shown: List[registry.ApiPackage]) -> str:
    """The reference's index (included by docs/api/index.md): the packages with their summaries, then
    fairscale's paths, and a hidden toctree that puts every page in the sidebar."""
    lines = ["| package | what it holds |", "|---|---|"]
    lines += [f"| {{doc}}`{p.module} <generated/{p.module}>` | {p.summary} |" for p in shown if not p.face]
    lines += ["", "fairscale's import paths, each a table of links to the objects above:", ""]
    lines += ["| shardkit path | fairscale's |", "|---|---|"]
    lines += [f"| {{doc}}`{p.module} <generated/{p.module}>` | `{p.summary}` |" for p in shown if p.face]
    lines += ["", "```{toctree}", ":hidden:", ""]
    lines += [f"generated/{p.module}" for p in shown if not p.face] + [f"generated/{p.module}" for p in shown if p.face]
    return "\n".join([*lines, "```", ""])


def _write_pages(app: Sphinx) -> None:
    for problem in registry.check():
        LOGGER.warning("API reference: %s", problem, type="shardkit", subtype="api")
    ref = Reference()
    _STATE["reference"] = ref
    GENERATED.mkdir(parents=True, exist_ok=True)
    wanted = {}
    shown = [p for p in registry.PACKAGES if p.module in ref.modules]
    for package in shown:
        wanted[f"{package.module}.rst"] = _page(ref, package)
    wanted["_toc.inc"] = _index(shown)
    for old in GENERATED.iterdir():
        if old.name not in wanted:
            old.unlink()
    for name, text in wanted.items():
        path = GENERATED / name
        if not path.exists() or path.read_text() != text:  # unchanged pages keep their time: no needless rebuild
            path.write_text(text)


def _resolve(
    app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: nodes.TextElement
) -> Optional[nodes.Element]:
    """A reference to an object under the module defining it (type hints) goes to where it is described."""
    if node.get("refdomain") != "py":
        return None
    ref = _STATE.get("reference")
    if ref is None:
        return None
    name = node.get("reftarget", "")
    target = ref.defined_as.get(name)
    value = None
    if target is None:
        value = _lookup(name, node.get("py:module"), node.get("py:class"))
        target = ref.canonical.get(id(value)) if value is not None else None
    if target is None and "." not in name:
        target = ref.by_short_name.get(name)
    if target is not None:
        found = env.get_domain("py").resolve_any_xref(env, node["refdoc"], app.builder, target, node, contnode)
        if found:
            return found[0][1]
    if value is not None or _internal_name(node):
        return contnode  # shardkit's own internals (an internal module, a private base class): named, not linked
    return None


def _internal_name(node: pending_xref) -> bool:
    """A short name that some shardkit module defines (a type alias, a helper), or an instance attribute of a
    shardkit class: shardkit's own vocabulary, which the reference does not describe."""
    name = node.get("reftarget", "")
    if node.get("reftype") == "attr" and str(node.get("py:module") or "").startswith("shardkit"):
        return bool(node.get("py:class"))
    if "." in name:
        return False
    return any(
        module_name.startswith("shardkit") and module is not None and name in vars(module)
        for module_name, module in list(sys.modules.items())
    )


def _lookup(name: str, module: Optional[str], cls: Optional[str]) -> Optional[Any]:
    """The object ``name`` means in the docstring's module (or class), or as a full dotted path."""
    candidates = [name]
    if module:
        candidates += [f"{module}.{cls}.{name}"] if cls else []
        candidates.append(f"{module}.{name}")
    for dotted in candidates:
        value = _import_dotted(dotted)
        if value is not None:
            return value
    return None


def _import_dotted(dotted: str) -> Optional[Any]:
    parts = dotted.split(".")
    if parts[0] != "shardkit":
        return None
    for cut in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                value = getattr(value, part)
        except AttributeError:
            return None
        return value
    return None


def _napoleon_skipping_attributes(app: Sphinx) -> None:
    """napoleon reads a property's or attribute's first ``words: text`` as a type; shardkit's docstrings put prose
    there. So napoleon's handler runs for everything but attributes, properties and data."""
    listeners = app.events.listeners["autodoc-process-docstring"]
    for listener in list(listeners):
        if getattr(listener.handler, "__module__", "") == "sphinx.ext.napoleon":
            app.disconnect(listener.id)
            app.connect("autodoc-process-docstring", _except_attributes(listener.handler), priority=listener.priority)


def _except_attributes(handler: Any) -> Any:
    def process(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: List[str]) -> None:
        if what not in ("attribute", "property", "data"):
            handler(app, what, name, obj, options, lines)

    return process


def setup(app: Sphinx) -> Dict[str, Any]:
    app.setup_extension("sphinx.ext.napoleon")
    _napoleon_skipping_attributes(app)
    app.connect("builder-inited", _write_pages)
    app.connect("missing-reference", _resolve)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
