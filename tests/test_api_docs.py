"""The API reference covers every public name, a broken reference fails the strict build, and the
licence is stated where packagers and users look."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import stabletrain

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"


def _references() -> set[str]:
    return set(re.findall(r"^::: ([\w.]+)$", API.read_text(), re.M))


def test_every_public_name_is_in_the_api_reference():
    refs = _references()
    missing = []
    for name in stabletrain.__all__:
        if name == "__version__":
            continue
        obj = getattr(stabletrain, name)
        if f"{obj.__module__}.{name}" not in refs:
            missing.append(f"{name} (::: {obj.__module__}.{name})")
    assert not missing, f"docs/api.md lacks: {', '.join(missing)}"
    # and the settings groups, which are public as the keyword arguments of train()
    from stabletrain.config import TrainSettings

    groups = {f.annotation.__module__ + "." + f.annotation.__name__
              for f in TrainSettings.model_fields.values() if isinstance(f.annotation, type)
              and f.annotation.__name__.endswith("Args")}
    assert groups and groups <= refs, groups - refs


def _mkdocs() -> list[str]:
    exe = Path(sys.executable).with_name("mkdocs")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "mkdocs"]


def test_a_broken_reference_fails_the_strict_build(tmp_path):
    pytest.importorskip("mkdocstrings")
    pytest.importorskip("griffe_pydantic")
    config = (ROOT / "mkdocs.yml").read_text()
    config = re.sub(r"(?s)\nnav:.*", "\nnav:\n  - API: api.md\n", config)
    config = config.replace("docs_dir: docs", f"docs_dir: {tmp_path / 'docs'}").replace(
        "paths: [src]", f"paths: [{ROOT / 'src'}]")
    (tmp_path / "docs").mkdir()
    (tmp_path / "mkdocs.yml").write_text(config)
    (tmp_path / "docs" / "api.md").write_text("# API\n\n::: stabletrain.errors.ConfigError\n")
    ok = subprocess.run([*_mkdocs(), "build", "--strict", "-f", str(tmp_path / "mkdocs.yml"), "-d",
                         str(tmp_path / "site")], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    (tmp_path / "docs" / "api.md").write_text("# API\n\n::: stabletrain.errors.NoSuchError\n")
    bad = subprocess.run([*_mkdocs(), "build", "--strict", "-f", str(tmp_path / "mkdocs.yml"), "-d",
                          str(tmp_path / "site")], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "stabletrain.errors.NoSuchError" in bad.stderr


def test_licence_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("                                 Apache License\n                           Version 2.0")
    assert "END OF TERMS AND CONDITIONS" in text
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()
