"""``shardkit plan``: every strategy and setting for a model, over world sizes, ranked by predicted step time.

Examples::

    shardkit plan --hf llama hidden_size=4096,num_hidden_layers=32,intermediate_size=11008 --world-sizes 8,64
    shardkit plan mypkg.models:build --batch-shape 8,512 --loss cross_entropy --device-memory 40GiB --json out.json
    shardkit plan mypkg.models:build --batch-shape 8,512 --loss mypkg.models:loss_fn
    shardkit plan --hf ./my-model/config.json num_hidden_layers=48 --world-sizes 64,128
    shardkit plan --lm bench --world-sizes 2,4,8 --plot memory.png
    shardkit plan --lm smp --smp-layouts --world-sizes 8,16     # smp's pipeline x tensor x data layouts
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Optional

import torch

from shardkit.plan.api import Estimate, estimate
from shardkit.plan.cost import DeviceSpec, LinkSpec
from shardkit.plan.layouts import check_layout_flags, plan_layouts
from shardkit.plan.layouts_report import layout_table
from shardkit.plan.losses import LOSS_HELP, import_attribute, resolve_loss
from shardkit.plan.once import each_warning_once
from shardkit.plan.pipeline import V_SCHEDULES, chunk_problem, model_blocks, pipeline_bubble
from shardkit.plan.plot import save_plot
from shardkit.plan.report import plan_document, plot_title, position_hint, print_failures, recommend, table
from shardkit.plan.runner import LossFn, PlanError
from shardkit.plan.settings import SETTINGS, Setting
from shardkit.plan.strategies import PIPELINE, STRATEGIES
from shardkit.plan.workloads import Workload, check_model_factory

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
          "gb": 10**9, "tb": 10**12}  # fmt: skip


def parse_bytes(text: str) -> int:
    """``"80GiB"`` → 85899345920 (binary and decimal units, case-insensitive)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (write e.g. 80GiB, 40GB, 512MiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _overrides(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"config override {item!r} is not key=value")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def pipeline_settings(
    world_size: int, batch_size: int, blocks: Optional[int] = None
) -> tuple[list[Setting], list[str]]:
    """smp settings for ``world_size``: 2, 4 and 8 partitions dividing it, with two micro-batches per stage,
    each under smp's 1F1B and shardkit's two zero-bubble schedules (ZB-H1 with its largest stage at about 1F1B's
    activation memory, ZB-H2 at about twice it), interleaved 1F1B over 2 and 4 virtual stages per rank, and ZBV
    (two chunks per rank in a V), each labelled with the bubble its schedule predicts
    (:func:`pipeline_bubble`). Returns the settings and, as ``"label xN: why"`` lines, the chunked ones the model
    cannot take (``blocks``: its layer count, where known; see :func:`chunk_problem`).

    A replica of ``p`` stages trains the ``p`` ranks' batches together, so the global batch stays that of the
    data-parallel settings.
    """
    out: list[Setting] = []
    skipped: list[str] = []
    for parts in (2, 4, 8):
        if world_size % parts:
            continue
        # Two micro-batches per stage when the batch allows (1F1B's bubble 1/3 of the step), else one each.
        micro = 2 * parts if (batch_size * parts) % (2 * parts) == 0 else parts
        for schedule, virtual, name in PIPELINE_SCHEDULES:
            config = {"partitions": parts, "microbatches": micro, "pipeline": schedule}
            if virtual > 1:
                config["virtual_stages"] = virtual
            shape = f"{parts} stages x {micro} mb"
            chunked = virtual > 1 or schedule in V_SCHEDULES
            why = chunk_problem(schedule, parts, virtual, micro, blocks) if chunked else ""
            if why:
                skipped.append(f"pipeline ({name}) {shape} x{world_size}: {why}")
                continue
            idle = pipeline_bubble(schedule, parts, micro, virtual)
            out.append(Setting(f"pipeline ({name}) {shape}, bubble {idle:.0%}", "smp", config, batch_ranks=parts))
    return out, skipped


#: The smp schedules the planner compares: (pipeline, virtual stages per rank, the label each setting carries).
PIPELINE_SCHEDULES = (
    ("interleaved", 1, "smp"),
    ("zero_bubble", 1, "smp ZB-H1"),
    ("zero_bubble_h2", 1, "smp ZB-H2"),
    ("interleaved", 2, "smp, 2 virtual stages"),
    ("interleaved", 4, "smp, 4 virtual stages"),
    ("zbv", 2, "smp ZBV"),
    ("dualpipev", 2, "smp DualPipeV"),
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardkit plan", description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", help="package.module:factory building the model (or use --hf / --lm)")
    p.add_argument(
        "--hf",
        nargs="+",
        metavar=("TYPE", "KEY=VALUE,..."),
        help="transformers model type (or a local config.json, or a model folder holding one) + config overrides",
    )
    p.add_argument("--lm", choices=("bench", "demo", "smp"), help="shardkit's bench or demo LM, or the smp.nn LM")
    p.add_argument("--batch-shape", type=_ints, help="one rank's token batch for a factory model, e.g. 8,512")
    p.add_argument("--batch-size", type=_positive, default=8, help="sequences per rank (--hf, --lm)")
    p.add_argument("--seq-len", type=_positive, default=None, help="tokens per sequence (--hf default 2048)")
    p.add_argument(
        "--loss",
        default=None,
        help=f"the training loss: {LOSS_HELP} (default: the task's loss for --hf and --lm, mean for a factory)",
    )
    p.add_argument("--world-sizes", type=_ints, default=[8], help="comma-separated world sizes (default 8)")
    p.add_argument(
        "--tensor-parallel", type=_positive, default=1,
        help="tensor-parallel degree: the factory model builds shardkit.tensor_parallel layers (default 1)",
    )  # fmt: skip
    p.add_argument(
        "--smp-layouts", action="store_true",
        help="list and plan smp's 3-D layouts (pipeline x tensor x data) of a model of smp.nn layers (--lm smp or a "
        "factory) instead of the strategies",
    )  # fmt: skip
    p.add_argument("--smp-sharded", action="store_true", help="with --smp-layouts: also with sharded data parallel")
    p.add_argument("--smp-prescaled", action="store_true", help="with --smp-layouts: also with prescaled_batch")
    p.add_argument("--nprocs-per-node", type=int, default=None, help="ranks per node (intra/inter-node bytes)")
    p.add_argument("--strategies", default=None, help="comma-separated subset: ddp,oss_ddp,oss_sdp,fsdp,slowmo,smp")
    p.add_argument("--device-memory", type=parse_bytes, default=parse_bytes("80GiB"), help="memory per device")
    p.add_argument(
        "--host-memory",
        type=parse_bytes,
        default=parse_bytes("256GiB"),
        help="host (CPU) memory per rank for offloaded state (default 256GiB: 2 TiB per node of 8)",
    )
    p.add_argument("--host-link-gbytes", type=float, default=25.0, help="GB/s between host memory and a device")
    p.add_argument("--device-tflops", type=float, default=300.0, help="sustained TFLOP/s per device")
    p.add_argument("--link-gbytes", type=float, default=25.0, help="GB/s each rank sends between nodes")
    p.add_argument("--intra-gbytes", type=float, default=150.0, help="GB/s each rank sends inside its node")
    p.add_argument("--link-latency-us", type=float, default=30.0, help="microseconds per collective")
    p.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default="nccl",
        help="the planned run's backend: nccl (accelerators, default) or gloo (a CPU run's direct-send paths)",
    )
    p.add_argument(
        "--optimizer",
        default="AdamW",
        help="a torch.optim class by name (default AdamW; e.g. SGD, Adam, Adagrad): its state is planned",
    )
    p.add_argument(
        "--optimizer-options", type=_overrides, default={}, metavar="KEY=VALUE,...", help="e.g. momentum=0.9"
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        help="write the plan as JSON: device and host memory, every estimate with whether it fits, the "
        "recommendation per world size, what could not be planned",
    )
    p.add_argument("--plot", metavar="PATH", help="write a PNG: peak memory per rank against world size, and what fits")
    return p


def _optimizer(name: str, parser: argparse.ArgumentParser) -> type:

    found = {n.lower(): getattr(torch.optim, n) for n in dir(torch.optim) if not n.startswith("_")}
    found = {n: c for n, c in found.items() if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)}
    found.pop("optimizer", None)  # the base class
    cls = found.get(name.lower())
    if cls is None:
        known = sorted(found)
        parser.error(f"--optimizer {name!r} is not a torch.optim optimizer; one of: {', '.join(known)}")
    return cls


def _workload(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Workload:
    return replace(
        _model_workload(args, parser),
        optimizer=_optimizer(args.optimizer, parser),
        optimizer_options=dict(args.optimizer_options),
        tensor_parallel=args.tensor_parallel,
    )


def _model_workload(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Workload:
    chosen = [x for x in (args.model, args.hf, args.lm) if x]
    if len(chosen) != 1:
        parser.error("give exactly one model: package.module:factory, --hf TYPE [overrides] or --lm bench|demo")
    if args.hf:
        overrides = _overrides(args.hf[1]) if len(args.hf) > 1 else {}
        return Workload.hf(args.hf[0], overrides, batch_size=args.batch_size, seq_len=args.seq_len or 2048)
    if args.lm:
        maker = {"bench": Workload.bench_lm, "demo": Workload.demo_lm, "smp": Workload.smp_lm}[args.lm]
        work = maker(batch_size=args.batch_size)
        return replace(work, seq_len=args.seq_len) if args.seq_len else work
    if ":" not in args.model:
        parser.error(f"model {args.model!r} must be package.module:factory")
    if not args.batch_shape or len(args.batch_shape) != 2:
        parser.error("a factory model needs --batch-shape BATCH,SEQ (one rank's token ids)")
    module_name, _, factory = args.model.partition(":")
    # A clear error now, not after every setting failed.
    check_model_factory(import_attribute(module_name, factory, "model"), args.model, {})
    batch, seq = args.batch_shape
    return Workload("factory", args.model, {}, batch_size=batch, seq_len=seq)


def _loss(args: argparse.Namespace, work: Workload) -> LossFn:
    """The loss named by ``--loss``, else the workload's own (a factory's: the output's mean)."""
    if args.loss:
        return resolve_loss(args.loss)
    return resolve_loss("mean") if work.kind == "factory" else work.loss


def plan_all(
    work: Workload,
    world_sizes: Sequence[int],
    settings: Sequence[Setting],
    device: DeviceSpec,
    link: LinkSpec,
    nprocs_per_node: Optional[int] = None,
    backend: str = "nccl",
    loss: Optional[LossFn] = None,
) -> tuple[list[tuple[Setting, Estimate]], list[str]]:
    """Every setting at every world size (planning a run on ``backend``, training with ``loss``: default the
    workload's, a factory's the output's mean); estimates, and lines for the ones that could not be planned.
    Each warning the model gives while it is built over and over is shown once."""
    with each_warning_once():
        return _plan_all(work, world_sizes, settings, device, link, nprocs_per_node, backend, loss)


def _plan_all(
    work: Workload,
    world_sizes: Sequence[int],
    settings: Sequence[Setting],
    device: DeviceSpec,
    link: LinkSpec,
    nprocs_per_node: Optional[int],
    backend: str,
    loss: Optional[LossFn],
) -> tuple[list[tuple[Setting, Estimate]], list[str]]:
    results: list[tuple[Setting, Estimate]] = []
    failed: list[str] = []
    if loss is None:
        loss = resolve_loss("mean") if work.kind == "factory" else work.loss
    blocks = None
    if any(s.strategy == "smp" for s in settings):  # the layer count, for the pipelines over chunks
        with torch.device("meta"):
            blocks = model_blocks(work.build())
    for ws in world_sizes:
        per_node = nprocs_per_node if nprocs_per_node is not None and ws % nprocs_per_node == 0 else None
        with_pipelines = [s for s in settings if s.strategy != "smp"]
        if any(s.strategy == "smp" for s in settings):
            pipelines, skipped = pipeline_settings(ws, work.batch_size, blocks)
            with_pipelines += pipelines
            failed += skipped
        for setting in with_pipelines:
            if work.tensor_parallel > 1 and (ws % work.tensor_parallel or setting.strategy == "smp"):
                failed.append(f"{setting.label} x{ws}: not planned with tensor parallelism {work.tensor_parallel}")
                continue
            if setting.needs_nodes and (nprocs_per_node is None or nprocs_per_node in (1, ws)):
                continue  # hybrid sharding needs several nodes of several ranks
            setting_work = replace(
                work,
                batch_size=work.batch_size * setting.batch_ranks,
                activation_checkpointing=setting.checkpointing,
                offload_activations=setting.offload_activations,
            )
            build = setting_work.build
            try:
                est = estimate(
                    build, setting_work.batch(), loss_fn=loss, strategy=setting.strategy, world_size=ws,
                    optimizer=work.optimizer, optimizer_options=work.optimizer_options,
                    strategy_options=setting.options, device=device, link=link,
                    nprocs_per_node=per_node, backend=backend, tensor_parallel=work.tensor_parallel,
                )  # fmt: skip
            except PlanError as exc:
                failed.append(f"{setting.label} x{ws}: {exc}{position_hint(work)}")
                continue
            results.append((setting, est))
    return results, failed


def _settings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Setting]:
    if not args.strategies:
        return list(SETTINGS)
    known = [*STRATEGIES, PIPELINE]
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        parser.error(
            f"no known strategy {', '.join(map(repr, unknown))} in --strategies; choose from {','.join(known)}"
        )
    return [s for s in SETTINGS if s.strategy in names]


def _check_output_paths(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse an output path that cannot be written before planning, not after minutes of it."""
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"{flag} {path}: the folder {os.path.dirname(os.path.abspath(path))} does not exist")
    if args.plot and not args.plot.lower().endswith(".png"):
        parser.error(f"--plot {args.plot}: give a .png path")


def main(argv: Optional[list[str]] = None) -> int:
    """Run ``shardkit plan`` with ``argv``; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.nprocs_per_node is not None and (
        args.nprocs_per_node < 1
        or any(ws % args.nprocs_per_node for ws in args.world_sizes if ws > args.nprocs_per_node)
    ):
        parser.error(f"--nprocs-per-node {args.nprocs_per_node} must be positive and divide every world size above it")
    settings = _settings(args, parser)
    _check_output_paths(args, parser)
    check_layout_flags(args, parser)
    device = DeviceSpec(
        flops_per_s=args.device_tflops * 1e12,
        memory_bytes=args.device_memory,
        host_link_bytes_per_s=args.host_link_gbytes * 1e9,
    )
    link = LinkSpec(
        bytes_per_s=args.link_gbytes * 1e9,
        intra_bytes_per_s=args.intra_gbytes * 1e9,
        latency_s=args.link_latency_us * 1e-6,
    )
    try:
        with each_warning_once():
            work = _workload(args, parser)
            loss = _loss(args, work)
            if args.smp_layouts:
                variants = (args.smp_sharded, args.smp_prescaled)
                results, failed = plan_layouts(work, args.world_sizes, device, link, args.backend, loss, *variants)
            else:
                results, failed = plan_all(
                    work, args.world_sizes, settings, device, link, args.nprocs_per_node, args.backend, loss
                )
    except (ValueError, TypeError, NotImplementedError) as exc:  # PlanError and OptionError are ValueErrors
        print(f"shardkit plan: {exc}", file=sys.stderr)
        return 2
    if not results:
        print_failures(failed)
        print("shardkit plan: no setting could be planned (reasons above)", file=sys.stderr)
        return 2
    shown = layout_table if args.smp_layouts else table
    print(shown(results, args.device_memory, args.host_memory))
    print_failures(failed)
    if not args.nprocs_per_node and not args.smp_layouts:
        print("not planned here: hybrid sharding (give --nprocs-per-node)")
    for ws in args.world_sizes:
        planned = any(est.world_size == ws for _, est in results)
        print(recommend(results, args.device_memory, ws, args.host_memory) if planned else
              f"world size {ws}: no setting could be planned (reasons above)")  # fmt: skip
    if args.json:
        document = plan_document(results, args.world_sizes, args.device_memory, args.host_memory, args.backend, failed)
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)
    if args.plot:
        save_plot(results, args.plot, args.device_memory, plot_title(work), args.host_memory)
    return 0


__all__ = ["SETTINGS", "Setting", "main", "parse_bytes", "plan_all", "recommend"]
