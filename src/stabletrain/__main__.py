"""``python -m stabletrain``: the same as the ``stabletrain`` command."""

from stabletrain.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
