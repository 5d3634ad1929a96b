"""gpu-check part ``tp``: tensor parallelism (``shardkit.nn.model_parallel``, fairscale's names) at model-parallel
size 2 over two ranks, in the form this machine allows (two GPUs: NCCL; one GPU: both ranks share it over gloo).

The model is :class:`~.tp_llama.TinyLlama`. Each rank builds it split in two, merges the two halves of the initial
weights (:func:`shardkit.tensor_parallel.merge_state_dicts`) and, in the same process, builds the unsplit model at
size 1 from them: the reference. Checks, each agreed over both ranks and recorded by rank 0:

* the logits at size 2 equal the reference's; three SGD steps give the reference's losses and weights (every
  rank's half against the same half of the reference's), under deterministic kernels, within the tolerances below;
* the comm meter's bytes and calls per step are the all-reduces and all-gathers the model must issue
  (:func:`~.tp_llama.expected_comm_per_step`), exactly (the logits' forward before them ran each layer's one-time
  input check);
* dropout on the RNG tracker's model-parallel stream draws a different mask on each rank, the default stream the
  same one, and a training-mode forward with dropout still gives both ranks the same logits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from shardkit.bench.gpu_check.common import PartContext, deterministic, device, loss_gap, max_diff
from shardkit.bench.gpu_check.results import Outcome, Results, all_true, at_most
from shardkit.bench.gpu_check.tp_llama import LlamaConfig, TinyLlama, expected_comm_per_step, llama_config

MP_SIZE = 2
STEPS = 3
ROWS = 4
LR = 0.1
DROPOUT = 0.3
#: Largest logit difference, size 2 against size 1 (fp32; the row-parallel layers add two partial sums where the
#: unsplit layer sums once, so the last bits differ: 1.5e-6 on CPU at full size, logits up to 2.2).
LOGITS_TOLERANCE = 1e-4
#: Largest difference of a loss, or of a weight after the three steps, size 2 against size 1 (on CPU at full size:
#: 1e-6 and 1.2e-7; a missing or doubled reduction moves them by 1e-2 or more).
TRAIN_TOLERANCE = 5e-5
CHECKS = ("tp:logits_tp2_equal_tp1", "tp:three_steps_tp2_equal_tp1", "tp:comm_bytes_per_step",
          "tp:dropout_rng_tracker")  # fmt: skip


@contextmanager
def _model_parallel(size: int) -> Iterator[None]:
    """The model-parallel groups at ``size`` for the block (torn down even when the block fails)."""
    # imported in the check: on a lent machine's torch a module that fails to import fails only this check
    import shardkit.nn.model_parallel as mp

    mp.initialize_model_parallel(size)
    try:
        yield
    finally:
        mp.destroy_model_parallel()


def _tokens(cfg: LlamaConfig) -> torch.Tensor:
    """The same batch on every rank (tensor-parallel ranks must see the same one), one token longer than a step."""
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, cfg.vocab_size, (ROWS, cfg.seq_len + 1), generator=generator).to(device())


def _host_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _run(model: TinyLlama, tokens: torch.Tensor) -> dict[str, Any]:
    """Logits before training, then ``STEPS`` SGD steps: losses, the comm meter's count per step, final weights."""
    # imported in the check: on a lent machine's torch a module that fails to import fails only this check
    from shardkit.distributed import CommMeter, count_comm_bytes

    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        logits = model(inputs).cpu()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, comm = [], []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        with count_comm_bytes(CommMeter()) as meter:
            loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
            loss.backward()
        optimizer.step()
        losses.append(float(loss.item()))
        comm.append({op: {"calls": meter.calls[op], "wire_bytes": meter.wire_bytes[op]} for op in sorted(meter.calls)})
    return {"logits": logits, "losses": losses, "comm": comm, "state": _host_state(model)}


def tp2_against_tp1(cfg: LlamaConfig) -> dict[str, Any]:
    """This rank's gaps between the model at size 2 and the unsplit one built here from the merged weights."""
    # imported in the check: on a lent machine's torch a module that fails to import fails only this check
    import shardkit.nn.model_parallel as mp
    from shardkit import tensor_parallel as tp
    from shardkit.distributed.objects import all_gather_objects

    tokens = _tokens(cfg)
    with deterministic() as warned:
        with _model_parallel(MP_SIZE):
            torch.manual_seed(0)  # every rank draws the same full weights and keeps its part
            split = TinyLlama(cfg).to(device())
            specs, mp_rank = tp.tp_sharding(split), mp.get_model_parallel_rank()
            halves = all_gather_objects(_host_state(split), mp.get_model_parallel_group(), "gpu_check tp halves")
            merged = tp.merge_state_dicts(halves, specs)
            got = _run(split, tokens)
        with _model_parallel(1):
            whole = TinyLlama(cfg)
            whole.load_state_dict(merged)
            want = _run(whole.to(device()), tokens)
    want_half = tp.split_state_dict(want["state"], specs, MP_SIZE)[mp_rank]
    return {
        "logits_gap": float((got["logits"] - want["logits"]).abs().max()),
        "logits_scale": float(want["logits"].abs().max()),
        "loss_gap": loss_gap(got["losses"], want["losses"]),
        "weight_gap": max_diff(got["state"], want_half),
        "losses": got["losses"],
        "comm": got["comm"],
        "unsplit_comm": want["comm"],
        "nondeterministic_ops": warned,
    }


def dropout_case(cfg: LlamaConfig) -> dict[str, Any]:
    """Masks drawn on the tracker's model-parallel stream and on the default one, and a training-mode forward
    with dropout (its logits, and whether dropout changed them), on this rank."""
    # imported in the check: on a lent machine's torch a module that fails to import fails only this check
    import shardkit.nn.model_parallel as mp

    tokens = _tokens(cfg)[:, :-1]
    with _model_parallel(MP_SIZE):
        mp.model_parallel_cuda_manual_seed(1234)
        ones = torch.ones(4096, device=device())
        with mp.get_cuda_rng_tracker().fork():
            split_mask = F.dropout(ones, DROPOUT) == 0
        replicated_mask = F.dropout(ones, DROPOUT) == 0
        torch.manual_seed(0)
        model = TinyLlama(dataclasses.replace(cfg, dropout=DROPOUT)).to(device())
        with torch.no_grad():
            train_mode = model.train()(tokens).cpu()
            eval_mode = model.eval()(tokens).cpu()
    return {
        "split_mask": split_mask.cpu(),
        "replicated_mask": replicated_mask.cpu(),
        "train_logits": train_mode,
        "dropout_acted": bool((train_mode - eval_mode).abs().max() > 0),
    }


def _judge_logits(per_rank: list[dict[str, Any]]) -> Outcome:
    gap = max(r["logits_gap"] for r in per_rank)
    outcome = at_most(gap, LOGITS_TOLERANCE, "largest logit gap, model-parallel 2 against 1")
    value = {"logits_gap": gap, "logits_scale": per_rank[0]["logits_scale"]}
    value["nondeterministic_ops"] = per_rank[0]["nondeterministic_ops"]
    return dataclasses.replace(outcome, value=value)


def _judge_training(per_rank: list[dict[str, Any]]) -> Outcome:
    losses_gap, weights_gap = max(r["loss_gap"] for r in per_rank), max(r["weight_gap"] for r in per_rank)
    facts = {f"loss_gap<={TRAIN_TOLERANCE}": losses_gap <= TRAIN_TOLERANCE}
    facts[f"weight_gap<={TRAIN_TOLERANCE}"] = weights_gap <= TRAIN_TOLERANCE
    outcome = all_true(facts, f"{STEPS} SGD steps at model-parallel 2 as at 1: losses and every weight")
    value = {**facts, "loss_gap": losses_gap, "weight_gap": weights_gap, "losses": per_rank[0]["losses"]}
    return dataclasses.replace(outcome, value=value)


def _judge_comm(cfg: LlamaConfig, per_rank: list[dict[str, Any]]) -> Outcome:
    want = [expected_comm_per_step(cfg, ROWS, cfg.seq_len, MP_SIZE)] * STEPS
    facts: dict[str, Any] = {f"rank{r}_as_expected": found["comm"] == want for r, found in enumerate(per_rank)}
    facts["unsplit_sends_nothing"] = all(all(not step for step in r["unsplit_comm"]) for r in per_rank)
    outcome = all_true(facts, "per step, exactly the model's all-reduces and all-gathers (the comm meter)")
    value = {**facts, "expected": want, "rank0": per_rank[0]["comm"]}
    return dataclasses.replace(outcome, value=value)


def _judge_dropout(per_rank: list[dict[str, Any]]) -> Outcome:
    first, second = per_rank
    facts = {
        "tracker_masks_differ": not torch.equal(first["split_mask"], second["split_mask"]),
        "default_masks_equal": torch.equal(first["replicated_mask"], second["replicated_mask"]),
        "dropout_acted": first["dropout_acted"] and second["dropout_acted"],
    }
    logits_gap = float((first["train_logits"] - second["train_logits"]).abs().max())
    facts[f"train_logits_gap<={LOGITS_TOLERANCE}"] = logits_gap <= LOGITS_TOLERANCE
    rule = "tracker dropout differs across the ranks, default dropout agrees, the replicas' logits agree"
    outcome = all_true(facts, rule)
    return dataclasses.replace(outcome, value={**facts, "train_logits_gap": logits_gap, "p": DROPOUT})


def tp_worker(rank: int, world_size: int, small: bool, record: str) -> None:
    """Every tensor-parallel check, in the same order on both ranks; rank 0 writes the records."""
    # imported in the check: on a lent machine's torch a module that fails to import fails only this check
    from shardkit.bench.gpu_check.parts_ranks import agreed_check

    res = Results("tp", Path(record), resume=True) if rank == 0 else None
    cfg = llama_config(small)
    found: dict[str, Any] = {}

    def compare() -> dict[str, Any]:
        found.update(tp2_against_tp1(cfg))
        return found

    def already() -> dict[str, Any]:
        if not found:
            raise RuntimeError("the model-parallel 2 against 1 run (the logits check) did not finish")
        return found

    agreed_check(res, CHECKS[0], compare, _judge_logits)
    agreed_check(res, CHECKS[1], already, _judge_training)
    agreed_check(res, CHECKS[2], already, lambda per_rank: _judge_comm(cfg, per_rank))
    agreed_check(res, CHECKS[3], lambda: dropout_case(cfg), _judge_dropout)


def part_tp(res: Results, ctx: PartContext) -> None:
    """Tensor parallelism at size 2 over two ranks against the unsplit model; what the form leaves out, not run."""
    # imported in the check: on a lent machine's torch, a module that fails to import fails this check only
    from shardkit.bench.gpu_check.parts_ranks import run_ranks

    form = ctx.form()
    if form.backend != "nccl":
        res.not_run("tp:nccl_two_gpus", f"{form.label}: NCCL between tensor-parallel ranks needs two GPUs")
    run_ranks(res, ctx, tp_worker, (ctx.small, str(res.path)), list(CHECKS))
