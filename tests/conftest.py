from collections.abc import Iterator

import pytest
import torch

from testkit.speeds import mark_speeds, watch_unit


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_speeds(items)


@pytest.fixture(autouse=True)
def _unit_starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    yield from watch_unit(request, monkeypatch)
