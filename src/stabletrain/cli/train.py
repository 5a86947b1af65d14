"""``stabletrain train key=value ...``: train a model; the settings are those of :func:`stabletrain.train`.

    stabletrain train out=out/demo model_args.lr=0.01 precision=bf16-mixed
    stabletrain train --help          # every setting, its type, default and description

Settings are ``key=value`` pairs with dotted keys; they map one to one onto the keyword
arguments of :func:`stabletrain.train`.
"""

from __future__ import annotations

import textwrap

from stabletrain.errors import ConfigError

HELP = "train a model (stabletrain train --help lists every setting)"

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


def usage() -> str:
    """``stabletrain train --help``: every setting with its type, default and description."""
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


def run(argv: list[str]) -> int:
    """Parse ``key=value`` settings and train."""
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    from stabletrain.config import parse_cli_overrides
    from stabletrain.runfiles.commands import set_cli_invocation
    from stabletrain.training.preflight import check_without_torch

    overrides = parse_cli_overrides(argv)
    if "out" not in overrides:
        raise ConfigError("out: required setting is missing; e.g. stabletrain train out=out/demo")
    set_cli_invocation(argv)  # messages rebuild this command to continue the run
    try:
        # Loading torch takes seconds: what can be checked without it is checked first.
        check_without_torch(overrides)
        from stabletrain.training.loop import train

        train(**overrides)
    finally:
        set_cli_invocation(None)
    return 0
