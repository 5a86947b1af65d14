"""The reproductions of docs/mechanisms.md, for the tests: :mod:`stabletrain.training.reproductions` (the
benchmarks and the docs run the same settings from there)."""

from stabletrain.training.reproductions import *  # noqa: F401,F403
from stabletrain.training.reproductions import _run  # noqa: F401
