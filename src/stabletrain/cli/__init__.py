"""The ``stabletrain`` command line: one module per command, and argparse only here.

    stabletrain train out=out/demo model_args.lr=0.01      # stabletrain.cli.train
    stabletrain replay out/boom/debug/nan_capture/rank0     # stabletrain.cli.replay
    stabletrain diagnose out/boom/debug/nan_capture/rank0   # stabletrain.cli.diagnose
    stabletrain report out/demo                             # stabletrain.cli.report

Each command module has ``run(argv) -> exit code``; :func:`main` picks the command and turns
stabletrain's errors into messages and exit codes. The library never imports this package.
"""

from stabletrain.cli.main import COMMANDS, main

__all__ = ["main", "COMMANDS"]
