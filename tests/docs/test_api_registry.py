"""The API reference covers every public package and name (docs/_ext/api_registry.py), without building the site.

``make test`` also builds the site with warnings as errors (``make docs-strict``), where the same check runs; this
test gives the message in a second. A new public package fails here until it is registered (one line in
``PACKAGES``) or marked internal.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

EXT = Path(__file__).resolve().parents[2] / "docs" / "_ext"


@pytest.fixture(scope="module")
def registry() -> Iterator[ModuleType]:
    sys.path.insert(0, str(EXT))
    try:
        import api_registry

        yield api_registry
    finally:
        sys.path.remove(str(EXT))


def test_every_public_package_and_name_is_in_the_reference(registry: ModuleType) -> None:
    problems = registry.check()
    assert not problems, "\n".join(problems)


def test_an_unregistered_package_is_reported(registry: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    kept = tuple(p for p in registry.PACKAGES if p.module != "shardkit.plan")
    monkeypatch.setattr(registry, "PACKAGES", kept)
    assert any("package shardkit.plan is neither" in line for line in registry.check())


def test_a_name_without_a_docstring_is_reported(registry: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    import shardkit.plan

    monkeypatch.setattr(shardkit.plan.estimate, "__doc__", None)
    assert "shardkit.plan.estimate has no docstring" in registry.check()


def test_every_fairscale_name_listed_exists_and_maps_to_one_object(registry: ModuleType) -> None:
    aliases = registry.fairscale_aliases()
    import shardkit.nn

    assert "fairscale.nn.data_parallel.FullyShardedDataParallel" in aliases[id(shardkit.nn.FullyShardedDataParallel)]
    assert registry.smp_statuses()["DistributedModel"] == "same"
