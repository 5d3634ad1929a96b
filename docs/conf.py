"""Sphinx configuration for shardkit's documentation (``make docs``; ``make test`` builds it with -W -n).

Sphinx with autodoc/napoleon, furo and MyST: the tooling torch, fairscale and Lightning users know, an API
reference generated from the docstrings, and Markdown sources so the repository's .md files are included as they
are rather than copied.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(DOCS / "_ext"))

project = "shardkit"
author = "the shardkit authors"
copyright = "the shardkit authors, BSD-3-Clause"
release = version = __import__("shardkit").__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
    "api_pages",
    "bench_plot",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "**/_toc.inc", "benchmarks/generated"]
root_doc = "index"

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 4
suppress_warnings = ["myst.header"]  # the included notebooks (BENCHMARKS.md, ...) nest headings freely

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_inherit_docstrings = False
autodoc_mock_imports: list[str] = []
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Offline: no intersphinx. References to torch, Lightning and the standard library cannot resolve here, so they
# are not warned about; every reference to shardkit itself must resolve.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(nn|torch|lightning|transformers|safetensors|numpy|typing_extensions|collections|contextlib)(\..*)?"),
    (r"py:.*", r"(_thread|typing|enum|abc|pathlib|os|concurrent|types|dataclasses|threading|datetime|logging)\..*"),
    (r"py:.*", r"(Any|Optional|Union|Callable|Iterator|Iterable|Sequence|Mapping|Tuple|List|Dict|Set|Type)"),
    (r"py:.*", r"(Path|Tensor|Module|Parameter|ProcessGroup|ReduceOp|Work|DeviceMesh|Optimizer|Enum|NamedTuple)"),
    (r"py:.*", r"(int|float|str|bool|bytes|dict|list|tuple|set|object|type|None|Ellipsis|callable|optional)"),
    # shardkit.distributed.hybrid's alias for "a group pair, a 2-D DeviceMesh or a Topology" (internal module).
    (r"py:class", r"HybridSpec"),
    (r"py:.*", r"(T|_T|F|TypeVar|Self|Literal|Generator|Hashable|TextIO|Event|Thread|Queue)"),
]

html_theme = "furo"
html_title = f"shardkit {release}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {"source_repository": "", "navigation_with_keys": True}
