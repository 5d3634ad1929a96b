"""The ``shardkit`` command: ``demo`` (the main job), ``bench`` (side-by-side benchmarks), ``checkpoint``
(inspect, export and import checkpoints) and ``plan`` (memory and traffic of every strategy before a run).

Examples::

    shardkit demo                      # train the demo LM with every available strategy, 2 local processes
    shardkit bench                     # every benchmark suite
    shardkit bench zero --steps 20     # one suite, more steps
    shardkit bench zero --strategies ddp,oss_sdp --json out.json   # suite options are passed through
    shardkit checkpoint inspect runs/exp1/step_00000100
    shardkit plan --help
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

from shardkit.bench import SUITES, UnknownSuiteError, run_suites
from shardkit.utils.pipes import quiet_on_broken_pipe

#: Sub-commands with their own argument parsers: name -> (module, one-line help). Their ``main(argv) -> int``
#: gets every argument after the sub-command's name.
DELEGATED = {
    "checkpoint": ("shardkit.checkpoint.cli", "inspect, export or import a checkpoint (see shardkit checkpoint -h)"),
    "plan": ("shardkit.plan.cli", "memory and traffic of every strategy for a model (see shardkit plan -h)"),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardkit", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    demo = commands.add_parser(
        "demo", help="train a small LM with every available strategy and compare with the known loss floor"
    )
    demo.add_argument("--world-size", type=int, default=None, help="worker processes (default 2)")
    demo.add_argument("--steps", type=int, default=None, help="training steps per strategy")
    demo.add_argument("--strategies", default=None, help="comma-separated subset of strategies")
    demo.add_argument("--quick", action="store_true", help="tiny settings (seconds), for tests")
    demo.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")

    bench = commands.add_parser(
        "bench",
        help="run benchmark suites side by side and print tables",
        epilog="Other options (for example zero's --strategies and --json) are passed on to the suites.",
    )
    bench.add_argument("suites", nargs="*", metavar="SUITE", help=f"suites to run (default all: {', '.join(SUITES)})")
    bench.add_argument("--world-size", type=int, default=None, help="worker processes (default 2)")
    bench.add_argument("--steps", type=int, default=None, help="timed steps")
    bench.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps")
    bench.add_argument("--quick", action="store_true", help="tiny settings (seconds), for tests")
    for name, (_, text) in DELEGATED.items():
        commands.add_parser(name, help=text, add_help=False)
    return parser


def _delegated_main(name: str) -> Callable[[list[str]], int]:
    import importlib

    module = importlib.import_module(DELEGATED[name][0])
    entry: Callable[[list[str]], int] = module.main
    return entry


def _forwarded(args: argparse.Namespace, options: tuple[str, ...]) -> list[str]:
    """The options the user gave explicitly, back as command-line arguments for a sub-program."""
    argv: list[str] = []
    for option in options:
        value = getattr(args, option.replace("-", "_"))
        if value is None or value is False:
            continue
        argv += [f"--{option}"] if value is True else [f"--{option}", str(value)]
    return argv


@quiet_on_broken_pipe
def main(argv: Optional[list[str]] = None) -> int:
    """Run the ``shardkit`` command with ``argv`` (default: the process's arguments); returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:
        return _delegated_main(argv[0])(argv[1:])
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "demo":
        # start-up cost: torch and the strategies only for the command that trains
        from shardkit.demo.train import main as demo_main

        demo_main(_forwarded(args, ("world-size", "steps", "strategies", "quick", "json")))
        return 0
    try:
        failures = run_suites(args.suites, _forwarded(args, ("world-size", "steps", "warmup", "quick")) + extra)
    except UnknownSuiteError as exc:
        parser.error(str(exc))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
