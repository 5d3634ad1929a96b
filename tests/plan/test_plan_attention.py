"""SDPA planned as the device runs it: on meta the planner answers with the fused kernel's tensors, counted to the
byte as the CPU counts them, and transformers' SDPA models plan within 5% of real runs at sequence 256 and 1024."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F

from shardkit.plan.accountant import Accountant
from shardkit.plan.accuracy import compare
from shardkit.plan.attention import DeviceAttention
from shardkit.plan.workloads import Workload
from shardkit.utils.torch_compat import cpu_flash_attention_takes_gqa

CASES = {
    "causal": {"is_causal": True},
    "gqa": {"is_causal": True, "kv_heads": 2, "enable_gqa": True},
    "bool_mask": {"mask": torch.bool},
    "float_mask": {"mask": torch.float32},
    "dropout": {"is_causal": True, "dropout_p": 0.1},
    "bf16": {"is_causal": True, "dtype": torch.bfloat16},
}


def _attention_bytes(device: str, target: str, case: dict[str, Any]) -> tuple[int, int, dict[str, int]]:
    """Peak and forward-end bytes of one SDPA forward and backward, counted by the planner's accountant."""
    case = dict(case)
    dtype, kv_heads, mask_dtype = case.pop("dtype", torch.float32), case.pop("kv_heads", 4), case.pop("mask", None)
    with Accountant() as acct, DeviceAttention(target) as mode, torch.device(device):
        q = torch.empty(2, 4, 64, 16, dtype=dtype).requires_grad_()
        k, v = (torch.empty(2, kv_heads, 64, 16, dtype=dtype).requires_grad_() for _ in range(2))
        mask: Optional[torch.Tensor] = None
        if mask_dtype is torch.bool:
            mask = torch.ones(2, 1, 64, 64, dtype=torch.bool).tril()
        elif mask_dtype is not None:
            mask = torch.zeros(2, 1, 64, 64, dtype=mask_dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **case)
        forward_bytes = acct.current
        out.sum().backward()
    return acct.peak.total, forward_bytes, mode.calls


@pytest.mark.parametrize("name", list(CASES))
def test_meta_attention_counts_what_the_cpu_counts(name: str) -> None:
    cpu_peak, cpu_forward, _ = _attention_bytes("cpu", "cpu", CASES[name])
    meta_peak, meta_forward, calls = _attention_bytes("meta", "cpu", CASES[name])
    assert (meta_peak, meta_forward) == (cpu_peak, cpu_forward)
    # The CPU runs the math path only with dropout (and, before torch 2.9, with grouped-query attention);
    # everything else is flash attention, as planned.
    math = name == "dropout" or (name == "gqa" and not cpu_flash_attention_takes_gqa())
    assert calls == ({"MATH": 1} if math else {"FLASH_ATTENTION": 1})


def test_accelerator_plans_fused_kernels_without_the_quadratic_tensor() -> None:
    math_peak, _, _ = _attention_bytes("cpu", "cpu", CASES["dropout"])  # the math path: B x H x S x S weights
    peak, _, calls = _attention_bytes("meta", "accelerator", CASES["dropout"])
    assert calls == {"EFFICIENT_ATTENTION": 1}  # fp32 inputs: memory-efficient attention, dropout included
    assert peak < math_peak / 2
    _, _, calls = _attention_bytes("meta", "accelerator", CASES["bf16"])
    assert calls == {"FLASH_ATTENTION": 1}
    _, _, calls = _attention_bytes("meta", "accelerator", {**CASES["gqa"]})
    assert calls == {"MATH": 1}  # fp32 with fewer key heads: neither fused kernel takes it


def test_real_tensors_pass_through() -> None:
    q = torch.randn(1, 2, 8, 4)
    with DeviceAttention("accelerator") as mode:
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert mode.calls == {} and torch.equal(out, F.scaled_dot_product_attention(q, q, q, is_causal=True))


def test_unknown_target_is_refused() -> None:
    with pytest.raises(ValueError, match="target must be one of"):
        DeviceAttention("tpu")


#: Small transformers configs (vocabulary 1000, so attention is a visible share of the peak) with dropout off in
#: attention: the fused kernels run on the CPU then (with dropout the CPU runs the math path, as planned too).
SDPA_MODELS = {
    "gpt2": {"n_layer": 2, "n_embd": 64, "n_head": 2, "attn_pdrop": 0.0},
    "llama": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2},
    "bert": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "attention_probs_dropout_prob": 0.0},
}
POSITIONS = {"gpt2": "n_positions", "bert": "max_position_embeddings"}


def _sdpa_models(seq: int) -> list[Any]:
    out = []
    for model_type, config in SDPA_MODELS.items():
        overrides = {**config, "vocab_size": 1000}
        if model_type != "gpt2":
            overrides["intermediate_size"] = 128
        if model_type in POSITIONS:
            overrides[POSITIONS[model_type]] = seq
        work = Workload.hf(model_type, overrides, batch_size=2, seq_len=seq)
        out.append(pytest.param(work, id=f"{model_type}-seq{seq}"))
    return out


@pytest.mark.parametrize("work", [*_sdpa_models(256), *_sdpa_models(1024)])
def test_sdpa_models_plan_within_5_percent_of_real_runs(work: Workload) -> None:
    assert work.attention == "" and work.build().config._attn_implementation == "sdpa"
    for row in compare(work, ["ddp", "fsdp"], 2):
        assert abs(row.peak_error) <= 0.05, row.format()
        assert abs(row.state_error) <= 0.05, row.format()
        assert row.planned_comm == row.real_comm, row.format()


def _checkpointed_attention_peak(device: str) -> tuple[int, dict[str, int]]:
    from torch.utils.checkpoint import checkpoint

    def block(x: torch.Tensor) -> torch.Tensor:
        q = (x * 2).view(2, 64, 4, 16).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(2, 64, 64)

    with Accountant() as acct, DeviceAttention("cpu") as mode, torch.device(device):
        x = torch.empty(2, 64, 64).requires_grad_()
        checkpoint(block, x, use_reentrant=False).sum().backward()
    return acct.peak.total, mode.calls


def test_a_checkpoint_recomputed_in_backward_takes_the_forward_path() -> None:
    # The recomputation runs inside loss.backward(): it must be answered as the forward was, or torch's checkpoint
    # refuses the different saved tensors.
    peak, calls = _checkpointed_attention_peak("meta")
    assert calls == {"FLASH_ATTENTION": 2}  # forward and recomputation
    assert peak == _checkpointed_attention_peak("cpu")[0]


def test_outside_a_device_attention_meta_runs_the_math_path_as_before() -> None:
    q = torch.empty(2, 4, 64, 16, device="meta", requires_grad=True)
    with DeviceAttention("cpu"):
        pass  # registers the meta kernel
    out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert out.grad_fn is not None and "Flash" not in type(out.grad_fn).__name__


def test_the_estimate_names_the_attention_kernel_it_planned() -> None:
    from shardkit.plan.api import estimate

    work = Workload.hf("gpt2", {**SDPA_MODELS["gpt2"], "vocab_size": 1000}, batch_size=1, seq_len=32)
    notes = {}
    for backend in ("gloo", "nccl"):
        est = estimate(work.build, work.batch(), loss_fn=work.loss, strategy="ddp", world_size=2, backend=backend)
        (notes[backend],) = [n for n in est.notes if "scaled_dot_product_attention" in n]
    # Two layers, three steps (DDP warms up twice): six calls.
    assert notes["gloo"].endswith("the cpu runs it: flash_attention (6 calls)")
    assert notes["nccl"].endswith("the accelerator runs it: efficient_attention (6 calls)")  # fp32 on CUDA
