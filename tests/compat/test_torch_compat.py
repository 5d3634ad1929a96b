"""The installed torch has every private or version-dependent API shardkit uses (see utils.torch_compat)."""

from __future__ import annotations

import torch

from shardkit.utils import torch_compat


def test_every_required_torch_api_resolves() -> None:
    assert torch_compat.missing() == {}, f"torch {torch.__version__}"


def test_a_missing_name_is_reported() -> None:
    api = torch_compat.TorchAPI("torch", "no_such_thing_here", "nowhere")
    assert api.problem() == "torch has no no_such_thing_here"
    keyword = torch_compat.TorchAPI("torch.compiler", "disable", "x", keyword="no_such_keyword")
    assert "takes no no_such_keyword=" in keyword.problem()
    assert "cannot import" in torch_compat.TorchAPI("torch.no_such_module", "", "x").problem()
