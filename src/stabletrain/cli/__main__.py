"""``python -m stabletrain.cli``: the same as ``stabletrain``."""

from stabletrain.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
