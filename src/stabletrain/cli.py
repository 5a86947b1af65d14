"""``stabletrain`` command line.

    stabletrain train out=out/demo model_args.lr=0.01 precision=bf16-mixed
    stabletrain train --help          # every setting, its type, default and description

Settings are ``key=value`` pairs with dotted keys; they map one to one onto the keyword
arguments of :func:`stabletrain.train`.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Callable, Optional

from stabletrain import __version__
from stabletrain.errors import ConfigError, StabletrainError
from stabletrain.signals import TrainingInterrupted

EXAMPLES = """\
examples:
  stabletrain train out=out/demo
  stabletrain report out/demo
  stabletrain train out=out/lm model_args.lr=3e-4 steps=2000 precision=bf16-mixed
  stabletrain train out=out/img model=torchvision/resnet18 data=path/to/images transform_args.image_size=64
  stabletrain train out=out/boom model_args.optimizer=sgd model_args.lr=1000 debug_args.nancapture.enabled=true
  stabletrain replay out/boom/debug/nan_capture/rank0
  stabletrain diagnose out/boom/debug/nan_capture/rank0
"""


def _train_help() -> str:
    from stabletrain.config import settings_help

    lines = [
        "usage: stabletrain train key=value [key=value ...]",
        "",
        "Train a model; gradient_norm is logged at every logging step. Keys are dotted",
        "(model_args.lr=0.01); values are JSON where possible (true, null, [1,2]), else strings.",
        "The same settings are keyword arguments of stabletrain.train() in Python.",
        "",
        "settings:",
    ]
    for name, typ, default, desc in settings_help():
        lines.append(f"  {name}  ({typ}, default {default})")
        if desc:
            lines.extend(textwrap.wrap(desc, width=92, initial_indent=" " * 6, subsequent_indent=" " * 6))
    lines += ["", EXAMPLES]
    return "\n".join(lines)


def _cmd_train(args: list[str]) -> int:
    if any(a in ("-h", "--help") for a in args):
        print(_train_help())
        return 0
    from stabletrain.commands import set_cli_invocation
    from stabletrain.config import parse_cli_overrides
    from stabletrain.trainer import train

    overrides = parse_cli_overrides(args)
    if "out" not in overrides:
        raise ConfigError("out: required setting is missing; e.g. stabletrain train out=out/demo")
    set_cli_invocation(args)  # messages rebuild this command to continue the run
    try:
        train(**overrides)
    finally:
        set_cli_invocation(None)
    return 0


def _cmd_replay(args: list[str]) -> int:
    from stabletrain.debug.replay import replay_main

    return replay_main(args)


def _cmd_diagnose(args: list[str]) -> int:
    from stabletrain.debug.diagnose import diagnose_main

    return diagnose_main(args)
def _cmd_report(args: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="stabletrain report",
        description=(
            "Read OUT/metrics.jsonl, find exploding/vanishing/spiking/plateau/non-finite episodes "
            "and write OUT/report/: summary.md, gradient_norm.png, loss.png and, when per-layer "
            "norms were logged, gradient_norm_layers.png."
        ),
    )
    parser.add_argument("out", help="a training run's output folder, e.g. out/my_run")
    parser.add_argument("--no-plots", action="store_true", help="write the summary only")
    ns = parser.parse_args(args)
    from stabletrain.reporting import report

    report(ns.out, plots=not ns.no_plots)
    return 0


#: name -> (one-line help, function taking the remaining arguments and returning an exit code)
COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "train": ("train a model (stabletrain train --help lists every setting)", _cmd_train),
    "replay": ("rerun a captured NaN step offline: stabletrain replay PATH [--json]", _cmd_replay),
    "diagnose": ("which op, module and sample made a captured step NaN, and why: stabletrain diagnose PATH [--json]", _cmd_diagnose),
    "report": ("trends and plots of a run: stabletrain report out/my_run", _cmd_report),
}


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="stabletrain",
        description="Training that finds and fixes instabilities.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {n:<10} {h}" for n, (h, _) in COMMANDS.items()),
    )
    parser.add_argument("--version", action="version", version=f"stabletrain {__version__}")
    parser.add_argument("command", choices=list(COMMANDS), metavar="command")
    if not argv or argv[0] in ("-h", "--help", "--version"):
        parser.parse_args(argv)
        return 0
    ns, rest = parser.parse_known_args(argv[:1])
    _, run = COMMANDS[ns.command]
    try:
        return run(argv[1:])
    except ConfigError as exc:
        print(f"stabletrain {ns.command}: {exc}", file=sys.stderr)
        return 2
    except TrainingInterrupted as exc:
        # The checkpoint and the command to continue were printed; exit as the signal asks.
        return exc.exit_code
    except StabletrainError as exc:
        print(f"stabletrain {ns.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
