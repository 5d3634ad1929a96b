"""List every fairscale name, argument and attribute that real fairscale users' code uses (a static scan).

Reads Python files straight from bare git mirrors (no work tree needed) and parses them with :mod:`ast`:

- imports of ``fairscale`` names (``from fairscale.nn import wrap as w`` makes ``w`` mean ``fairscale.nn.wrap``);
- calls of those names: how many positional arguments and which keywords (``functools.partial(name, ...)``
  counts as a call);
- classes deriving from a fairscale class: ``super().method(...)`` calls and ``self.<attr>`` reads the subclass
  does not define itself;
- attribute reads and calls on fairscale objects: variables assigned from a fairscale constructor, parameters
  annotated with a fairscale class, and names tested with ``isinstance(x, <fairscale class>)`` in the same
  function.

The last kind is a best effort: a static scan cannot follow objects across files. Each attribute is also looked
up in fairscale 0.4.13's own source (same mirrors): ``fairscale_defines`` says whether fairscale's class (or a
fairscale base of it, or a module-level ``function.attr = ...``) defines it; one that fairscale does not define
comes from torch's base class or falls through to the wrapped user module. Output: JSON, one entry per
(kind, fairscale name), with the keywords seen, the most positional arguments seen and where. Usage::

    python tools/fairscale_users_scan.py --mirrors /work/.mirror > tests/compat/fairscale_users.json
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

#: (label, mirror folder name, git revision, path prefixes scanned). Lightning 1.x: its last 1.x release.
USERS: list[tuple[str, str, str, tuple[str, ...]]] = [
    ("fairseq", "facebookresearch+fairseq", "HEAD", ("fairseq/", "fairseq_cli/", "examples/")),
    ("vissl", "facebookresearch+vissl", "HEAD", ("vissl/", "tools/", "extra_scripts/")),
    ("ClassyVision", "facebookresearch+ClassyVision", "HEAD", ("classy_vision/",)),
    ("mmf", "facebookresearch+mmf", "HEAD", ("mmf/", "mmf_cli/")),
    ("lightning-1.9.5", "Lightning-AI+lightning", "1.9.5", ("src/pytorch_lightning/", "src/lightning_fabric/")),
]


@dataclass
class Use:
    """Every use of one fairscale name in one way."""

    kind: str  # "import", "call", "attribute", "subclass"
    name: str
    keywords: set[str] = field(default_factory=set)
    max_positional: int = 0
    where: list[str] = field(default_factory=list)


class Uses:
    """The scan's result, keyed by (kind, name)."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[str, str], Use] = {}

    def add(self, kind: str, name: str, where: str, keywords: tuple[str, ...] = (), positional: int = 0) -> None:
        use = self.by_key.setdefault((kind, name), Use(kind, name))
        use.keywords.update(keywords)
        use.max_positional = max(use.max_positional, positional)
        if where not in use.where:
            use.where.append(where)

    def as_json(self, fairscale: dict[str, set[str]]) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for u in sorted(self.by_key.values(), key=lambda u: (u.name, u.kind)):
            entry: dict[str, object] = {"kind": u.kind, "name": u.name}
            if u.kind == "call":
                entry.update(keywords=sorted(u.keywords), max_positional=u.max_positional)
            if u.kind in ("attribute", "call") and u.name.count(".") >= 2:
                owner, _, attr = u.name.rpartition(".")
                owner_short = owner.rsplit(".", 1)[-1]
                if owner_short in fairscale or owner_short[:1].isupper():
                    entry["fairscale_defines"] = attr in fairscale.get(owner_short, set())
            entry["where"] = sorted(u.where)
            out.append(entry)
        return out


def _dotted(node: ast.AST) -> Optional[str]:
    """``a.b.c`` for a chain of attributes on a name (``self.x`` included), else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _is_isinstance_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "isinstance"
        and len(node.args) == 2
    )


class FileScan(ast.NodeVisitor):
    """The uses in one file; ``aliases`` maps local names to fairscale names."""

    def __init__(self, uses: Uses, label: str) -> None:
        self.uses, self.label = uses, label
        self.aliases: dict[str, str] = {}
        self.instances: list[dict[str, str]] = [{}]  # spelling -> fairscale class, per function scope
        self.classes: list[tuple[str, set[str]]] = []  # (fairscale base, names the subclass defines)
        self.called: set[int] = set()  # attribute nodes that are called (recorded as calls, not reads)

    # ---------------------------------------------------------------- names
    def resolve(self, node: ast.AST) -> Optional[str]:
        dotted = _dotted(node)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        if head in self.aliases:
            return f"{self.aliases[head]}.{rest}" if rest else self.aliases[head]
        return None

    def instance_of(self, node: ast.AST) -> Optional[str]:
        dotted = _dotted(node)
        for scope in reversed(self.instances):
            if dotted in scope:
                return scope[dotted]
        if self.classes and dotted == "self":
            return self.classes[-1][0]
        return None

    def where(self, node: ast.AST) -> str:
        return f"{self.label}:{getattr(node, 'lineno', 0)}"

    # ---------------------------------------------------------------- imports
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == "fairscale":
                self.aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "fairscale"
                self.uses.add("import", alias.name, self.where(node))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.module.split(".")[0] == "fairscale":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                self.aliases[alias.asname or alias.name] = full
                self.uses.add("import", full, self.where(node))

    # ---------------------------------------------------------------- scopes
    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        scope: dict[str, str] = {}
        for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
            cls = self.resolve(arg.annotation) if arg.annotation is not None else None
            if cls:
                scope[arg.arg] = cls
        for sub in ast.walk(node):  # isinstance(x, FairscaleClass) anywhere in the function
            if _is_isinstance_call(sub):
                assert isinstance(sub, ast.Call)
                classes = sub.args[1].elts if isinstance(sub.args[1], ast.Tuple) else [sub.args[1]]
                resolved = [self.resolve(c) for c in classes]
                spelled = _dotted(sub.args[0])
                if spelled and resolved and resolved[0]:
                    scope[spelled] = resolved[0]
        self.instances.append(scope)
        self.generic_visit(node)
        self.instances.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases = [self.resolve(b) for b in node.bases]
        base = next((b for b in bases if b), None)
        if base is None:
            self.generic_visit(node)
            return
        self.uses.add("subclass", base, self.where(node))
        defined = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and _dotted(sub.value) == "self":
                defined.add(sub.attr)
        self.classes.append((base, defined))
        self.generic_visit(node)
        self.classes.pop()

    # ---------------------------------------------------------------- assignments, calls, attributes
    def visit_Assign(self, node: ast.Assign) -> None:
        if isinstance(node.value, ast.Call):
            cls = self.resolve(node.value.func)
            if cls:
                for target in node.targets:
                    spelled = _dotted(target)
                    if spelled:
                        self.instances[-1][spelled] = cls
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        self.called.add(id(node.func))
        keywords = tuple(k.arg for k in node.keywords if k.arg is not None)
        positional = sum(1 for a in node.args if not isinstance(a, ast.Starred))
        target = self.resolve(node.func)
        if target is None and _dotted(node.func) in ("functools.partial", "partial") and node.args:
            target = self.resolve(node.args[0])
            positional -= 1
        if target is None and isinstance(node.func, ast.Attribute):
            target = self._method_target(node.func)
        if target is not None:
            self.uses.add("call", target, self.where(node), keywords, positional)
        self.generic_visit(node)

    def _method_target(self, func: ast.Attribute) -> Optional[str]:
        value = func.value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
            return f"{self.classes[-1][0]}.{func.attr}" if self.classes else None
        owner = self.instance_of(value)
        if owner is None or (_dotted(value) == "self" and self.classes and func.attr in self.classes[-1][1]):
            return None
        return f"{owner}.{func.attr}"

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if not node.attr.startswith("__") and id(node) not in self.called:
            owner = self.instance_of(node.value)
            own = _dotted(node.value) == "self" and self.classes and node.attr in self.classes[-1][1]
            if owner is not None and not own:
                self.uses.add("attribute", f"{owner}.{node.attr}", self.where(node))
            elif owner is None and isinstance(node.value, ast.Name) and node.value.id in self.aliases:
                self.uses.add("attribute", f"{self.aliases[node.value.id]}.{node.attr}", self.where(node))
        self.generic_visit(node)


FAIRSCALE = ("facebookresearch+fairscale", "v0.4.13")


def fairscale_definitions(repo: Path, rev: str) -> dict[str, set[str]]:
    """Class or function name -> the attribute names fairscale's source gives it (methods, class attributes,
    ``self.x = ...`` in its methods, ``name.x = ...`` at module level), bases inside fairscale included."""
    defined: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for path in _git(repo, "ls-tree", "-r", "--name-only", rev, "fairscale/").split():
        if not path.endswith(".py"):
            continue
        tree = ast.parse(_git(repo, "show", f"{rev}:{path}"))
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                names = defined.setdefault(node.name, set())
                bases.setdefault(node.name, []).extend(b for b in map(_dotted, node.bases) if b)
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(sub.name)
                    elif isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                        if _dotted(sub.value) == "self":
                            names.add(sub.attr)
                    elif isinstance(sub, (ast.Assign, ast.AnnAssign)) and sub in node.body:
                        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                        names.update(t.id for t in targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                        defined.setdefault(target.value.id, set()).add(target.attr)

    def closure(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        out = set(defined.get(name, ()))
        for base in bases.get(name, ()):
            short = base.rsplit(".", 1)[-1]
            if short in defined and short not in seen:
                out |= closure(short, seen | {name})
        return out

    return {name: closure(name) for name in defined}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def scan_repo(uses: Uses, label: str, repo: Path, rev: str, prefixes: tuple[str, ...]) -> int:
    """Scan the Python files under ``prefixes`` at ``rev`` that mention fairscale; returns how many."""
    listed = _git(repo, "grep", "-l", "fairscale", rev, "--", *[f"{p}*.py" for p in prefixes])
    scanned = 0
    for line in listed.splitlines():
        path = line.split(":", 1)[1]
        try:
            tree = ast.parse(_git(repo, "show", f"{rev}:{path}"))
        except (SyntaxError, subprocess.CalledProcessError):
            continue
        FileScan(uses, f"{label}:{path}").visit(tree)
        scanned += 1
    return scanned


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirrors", type=Path, required=True, help="folder holding <owner>+<name>/repo bare clones")
    args = parser.parse_args(argv)
    uses = Uses()
    files = {}
    for label, folder, rev, prefixes in USERS:
        repo = args.mirrors / folder / "repo"
        commit = _git(repo, "rev-parse", rev).strip()
        files[label] = {"commit": commit, "files": scan_repo(uses, label, repo, rev, prefixes)}
    fairscale_repo = args.mirrors / FAIRSCALE[0] / "repo"
    definitions = fairscale_definitions(fairscale_repo, FAIRSCALE[1])
    files["fairscale (definitions)"] = {"commit": _git(fairscale_repo, "rev-parse", FAIRSCALE[1]).strip(), "files": 0}
    json.dump({"sources": files, "uses": uses.as_json(definitions)}, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
