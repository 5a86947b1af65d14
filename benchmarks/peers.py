"""Peers' tools for the side-by-side benchmarks, loaded without their packages' other imports.

LightlyTrain (AGPL; not a dependency, not copied: loaded from the user's own install or wheel)
ships its underflow/overflow monitor as a vendored copy of transformers' ``DebugUnderflowOverflow``
(``lightly_train/_debug/huggingface_debug_utils.py``, which imports only torch), driven by its
``UnderflowOverflowMonitor`` wrapper with ``batch_number_mode="manual"`` and ``set_batch_number(step)``
before each step. Importing ``lightly_train`` itself would pull in torchvision, OpenCV and the rest
of the package, so :func:`lightly_train_debug_module` loads that one file by path::

    pip download --no-deps lightly-train==0.18.0 -d /tmp/lt      # a 1 MB wheel; or pip install it
    python benchmarks/underflow_overflow_overhead.py --lightly-train /tmp/lt/lightly_train-0.18.0-py3-none-any.whl
"""

from __future__ import annotations

import importlib.util
import re
import sys
import types
import zipfile
from pathlib import Path
from typing import Optional

LT_FILE = "lightly_train/_debug/huggingface_debug_utils.py"


def _version_from(name: str) -> str:
    match = re.search(r"lightly_train-([0-9][^-]*)-", name)
    return match.group(1) if match else "unknown version"


def lightly_train_debug_module(path: Optional[str] = None) -> tuple[Optional[types.ModuleType], str]:
    """LightlyTrain's vendored ``huggingface_debug_utils`` module and a label naming its version,
    from ``path`` (a wheel, or the folder holding ``lightly_train/``) or from an installed
    ``lightly_train``; ``(None, why)`` when neither is there."""
    source: Optional[str] = None
    label = ""
    if path:
        p = Path(path)
        if p.is_file() and p.suffix == ".whl":
            with zipfile.ZipFile(p) as wheel:
                source = wheel.read(LT_FILE).decode("utf-8")
            label = f"LightlyTrain {_version_from(p.name)}"
        elif (p / LT_FILE).is_file():
            source = (p / LT_FILE).read_text(encoding="utf-8")
            dist = next(p.glob("lightly_train-*.dist-info"), None)
            label = f"LightlyTrain {_version_from(dist.name + '-') if dist else 'unknown version'}"
        else:
            return None, f"{path} is neither a lightly_train wheel nor a folder holding {LT_FILE}"
    else:
        spec = importlib.util.find_spec("lightly_train")  # finds the package without importing it
        if spec is None or not spec.submodule_search_locations:
            return None, ("LightlyTrain is not installed (pip download --no-deps lightly-train -d DIR, "
                          "then --lightly-train DIR/lightly_train-*.whl)")
        root = Path(next(iter(spec.submodule_search_locations))).parent
        source = (root / LT_FILE).read_text(encoding="utf-8")
        from importlib.metadata import version

        label = f"LightlyTrain {version('lightly-train')}"
    module = types.ModuleType("lightly_train_huggingface_debug_utils")
    module.__file__ = f"{path or 'lightly_train'}:{LT_FILE}"
    sys.modules[module.__name__] = module  # dataclasses and typing look modules up by name
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module, label
