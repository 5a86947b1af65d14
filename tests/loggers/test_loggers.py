"""TensorBoard, MLflow and W&B: each is read back with the library's own reader and holds the
same metrics at the same steps as metrics.jsonl, the resolved settings, and the events.

The training run is a subprocess (the real CLI) with W&B offline, MLflow on its default local
SQLite store, MLflow telemetry off, and HOME and every W&B folder inside tmp_path: nothing
touches the network or the user's home.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from conftest import cli_env, tiny_lm
from stabletrain.errors import ConfigError
from stabletrain.loggers.jsonl import read_metrics
from stabletrain.training.loop import train

TINY_CLI = [
    "model_args.n_layers=1", "model_args.n_heads=2", "model_args.dim=32", "model_args.context_length=16",
    "model_args.dropout=0", "model_args.warmup_steps=2", "batch_size=8",
]


def _offline_env(tmp_path: Path) -> dict[str, str]:
    env = cli_env()
    home = tmp_path / "home"
    env.update(
        HOME=str(home),
        WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"),
        WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"),
        WANDB_DATA_DIR=str(tmp_path / "wandb_data"),
        WANDB_DIR=str(tmp_path / "wandb_default_dir"),
        # matplotlib (imported by MLflow and W&B) keeps its font cache under $HOME/.cache; that is not a logger's write.
        MPLCONFIGDIR=str(tmp_path / "matplotlib"),
        MLFLOW_DISABLE_TELEMETRY="true",
        DO_NOT_TRACK="true",
    )
    env.pop("WANDB_API_KEY", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


@pytest.fixture(scope="module")
def run_all_loggers(tmp_path_factory):
    """An exploding run (so trend alerts give events), per-layer norms on, every logger on. The
    guard stops it at its first NaN (step 9) and logs that step's loss and gradient norm."""
    tmp = tmp_path_factory.mktemp("loggers")
    env = _offline_env(tmp)
    out = tmp / "boom"
    args = [
        "train", f"out={out}", "steps=10", "log_every_num_steps=2", "gradient_norm_per_layer=true",
        "model_args.optimizer=sgd", "model_args.lr=10",
        "loggers.mlflow.enabled=true", 'loggers.mlflow.tags={"team": "stability"}',
        "loggers.wandb.enabled=true", *TINY_CLI,
    ]
    result = subprocess.run(
        [sys.executable, "-m", "stabletrain", *args], cwd=tmp, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 1 and "NonFiniteStepError: Non-finite loss" in result.stderr, result.stderr[-3000:]
    rows, events = read_metrics(out / "metrics.jsonl")
    return {"tmp": tmp, "out": out, "env": env, "rows": rows, "events": events, "stdout": result.stdout}


def _same(a: float, b: float, rel: float = 0.0) -> bool:
    if isinstance(a, str) or isinstance(b, str):  # W&B's JSON spells NaN/Infinity as strings
        a, b = float(a), float(b)
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or math.isclose(a, b, rel_tol=rel)


def _expected(rows):
    """metric key -> {step: value} from metrics.jsonl."""
    table: dict[str, dict[int, float]] = {}
    for row in rows:
        for k, v in row.items():
            if k != "step":
                table.setdefault(k, {})[row["step"]] = v
    return table


def test_the_run_is_what_the_checks_need(run_all_loggers):
    rows, events = run_all_loggers["rows"], run_all_loggers["events"]
    assert [r["step"] for r in rows] == [0, 2, 4, 6, 8, 9]
    assert any(k.startswith("gradient_norm/blocks.0.attn") for k in rows[0])
    assert any(e["event"] == "trend_alert" for e in events)
    home = run_all_loggers["tmp"] / "home"
    assert not home.exists() or not any(home.rglob("*")), "nothing written to the (isolated) home folder"
    assert not (run_all_loggers["tmp"] / "mlflow.db").exists() and not (run_all_loggers["tmp"] / "mlruns").exists(), \
        "nothing written to the working directory"


def test_tensorboard_read_back_with_event_accumulator(run_all_loggers):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
    from tensorboard.plugins.hparams import plugin_data_pb2

    out, expected = run_all_loggers["out"], _expected(run_all_loggers["rows"])
    # What `tensorboard --logdir out/boom` does: find runs below the folder.
    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(out))
    mux.Reload()
    assert list(mux.Runs()) == ["tensorboard"]

    ea = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    assert sorted(ea.Tags()["scalars"]) == sorted(expected)
    for key, by_step in expected.items():
        got = {e.step: e.value for e in ea.Scalars(key)}
        assert sorted(got) == sorted(by_step), key
        for step, value in by_step.items():
            assert _same(got[step], float(np.float32(value)), rel=1e-6), (key, step)

    content = ea.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["model_args.lr"].number_value == 10.0
    assert hparams["model_args.optimizer"].string_value == "sgd"
    assert hparams["precision"].string_value == "32-true"

    texts = {tag: ea.Tensors(tag) for tag in ea.Tags()["tensors"]}
    events_text = [t.tensor_proto.string_val[0].decode() for t in texts["events/text_summary"]]
    assert any("gradient_norm is exploding" in t for t in events_text)
    settings_text = texts["settings/text_summary"][0].tensor_proto.string_val[0].decode()
    assert '"lr": 10.0' in settings_text


def test_mlflow_read_back_with_mlflow_client(run_all_loggers, monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient

    out, expected = run_all_loggers["out"], _expected(run_all_loggers["rows"])
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("stabletrain")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FAILED" and run.info.run_name == "boom", "the guard stopped it with an error"
    assert run.data.tags["team"] == "stability" and run.data.tags["stabletrain.out"] == str(out)
    assert run.data.params["model_args.lr"] == "10.0" and run.data.params["model_args.optimizer"] == "sgd"
    assert run.data.params["gradient_norm_per_layer"] == "True"
    assert sorted(run.data.metrics) == sorted(expected)
    for key, by_step in expected.items():
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert sorted(got) == sorted(by_step), key
        for step, value in by_step.items():
            assert _same(got[step], value), (key, step, got[step], value)
    assert run.info.artifact_uri.startswith((out / "mlruns").as_uri())
    local = Path(client.download_artifacts(run.info.run_id, "events.jsonl", str(tmp_path)))
    logged = [json.loads(line) for line in local.read_text().splitlines()]
    alerts = [e for e in run_all_loggers["events"] if e["event"] == "trend_alert"]
    assert [(e["kind"], e["signal"], e["step"]) for e in logged if e["event"] == "trend_alert"] == [
        (e["kind"], e["signal"], e["step"]) for e in alerts
    ]


def _wandb_records(run_dir: Path, env: dict[str, str]) -> list[dict]:
    """W&B's own reader of the offline transaction log: `wandb leet inspect --json`."""
    if Version(importlib.metadata.version("wandb")) < WANDB_FOR_TESTS:
        pytest.fail(f"reading offline W&B runs needs wandb>={WANDB_FOR_TESTS} (`leet inspect --json`): pip install -e '.[dev]'")
    result = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


#: `wandb leet inspect --json` came with wandb 0.31 (0.30's `leet inspect` prints text only).
WANDB_FOR_TESTS = Version("0.31")
#: wandb.init(reinit="create_new") came with wandb 0.19.10 (its release notes, "Added").
WANDB_FOR_LOGGER = Version("0.19.10")


def _floor(requirements: list[str], name: str) -> Version:
    floors = [
        Version(spec.version)
        for r in map(Requirement, requirements) if r.name == name
        for spec in r.specifier if spec.operator == ">="
    ]
    assert floors, (name, requirements)
    return max(floors)


def test_pyproject_wandb_floors_have_what_the_logger_and_these_tests_use():
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert 'reinit="create_new"' in (root / "src/stabletrain/loggers/wandb.py").read_text()
    assert _floor(extras["wandb"], "wandb") >= WANDB_FOR_LOGGER
    assert _floor(extras["dev"], "wandb") >= WANDB_FOR_TESTS


def test_wandb_read_back_from_the_offline_run_directory(run_all_loggers):
    out, expected = run_all_loggers["out"], _expected(run_all_loggers["rows"])
    run_dirs = list((out / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1 and list(run_dirs[0].glob("run-*.wandb"))
    records = _wandb_records(run_dirs[0], run_all_loggers["env"])

    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["project"] == "stabletrain" and run["display_name"] == "boom"
    config: dict = {}
    for r in records:
        if r["type"] in ("run", "config"):
            config.update(r[r["type"]].get("config", r[r["type"]]).get("update", {}))
    assert config["model_args"]["lr"] == 10.0 and config["precision"] == "32-true"

    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
    assert sorted(history) == [0, 2, 4, 6, 8, 9]
    for key, by_step in expected.items():
        for step, value in by_step.items():
            assert _same(history[step][key], value), (key, step)

    summaries = [r["summary"]["update"] for r in records if r["type"] == "summary"]
    events = [s["events"] for s in summaries if "events" in s][-1]
    logged = [e for e in run_all_loggers["events"]]
    def key(e):
        return e["event"], e.get("kind"), e["step"]

    assert [key(e) for e in events] == [key(e) for e in logged]
    assert [e["event"] for e in logged][-1] == "nonfinite_step", "the guard's stop is an event for every logger"


# ------------------------------------------------------------------------- missing libraries


@pytest.mark.parametrize("name,module", [("tensorboard", "tensorboard"), ("mlflow", "mlflow"), ("wandb", "wandb")])
def test_missing_library_is_a_config_error_before_training(tmp_path, monkeypatch, name, module):
    monkeypatch.setitem(sys.modules, module, None)  # what `import module` sees when it is not installed
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        train(out=out, loggers={name: {"enabled": True}}, **tiny_lm())
    assert f'pip install "stabletrain[{name}]"' in str(err.value)
    assert f"loggers.{name}.enabled" in err.value.problems[0]
    assert not out.exists(), "reported before anything is written"


def test_missing_libraries_are_all_listed_and_the_cli_exits_2(tmp_path, monkeypatch, capsys):
    from stabletrain.cli import main

    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    code = main(["train", f"out={tmp_path / 'run'}", "loggers.mlflow.enabled=true", "loggers.wandb.enabled=true"])
    assert code == 2
    err = capsys.readouterr().err
    assert 'pip install "stabletrain[mlflow]"' in err and 'pip install "stabletrain[wandb]"' in err


def test_tensorboard_auto_is_on_when_installed_and_quietly_off_when_not(tmp_path, monkeypatch):
    train(out=tmp_path / "with", **tiny_lm(steps=2))
    assert list((tmp_path / "with" / "tensorboard").glob("events.out.tfevents.*"))
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    train(out=tmp_path / "without", **tiny_lm(steps=2))
    assert not (tmp_path / "without" / "tensorboard").exists()
    assert (tmp_path / "without" / "metrics.jsonl").exists()


def test_broken_install_is_a_config_error_too(tmp_path, monkeypatch):
    from stabletrain.loggers.tensorboard import TensorBoardLogger

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # installed, but fails to import
    with pytest.raises(ConfigError, match=r'pip install "stabletrain\[tensorboard\]"'):
        TensorBoardLogger(tmp_path / "tb")


class _BrokenOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds torch.utils.tensorboard and fails to execute it, as a broken install does (e.g.
    protobuf too new for tensorboard: TypeError "Descriptors cannot be created directly")."""

    def find_spec(self, fullname, path, target=None):
        if fullname == "torch.utils.tensorboard":
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise TypeError("Descriptors cannot be created directly.")


@pytest.mark.parametrize("enabled", [True, "auto"])
@pytest.mark.parametrize("failure", ["ModuleNotFoundError", "TypeError"])
def test_broken_tensorboard_import_is_caught_before_anything_is_written(tmp_path, monkeypatch, enabled, failure):
    """The tensorboard package is there (find_spec finds it) but torch.utils.tensorboard,
    which the logger imports, fails: reported with the other settings problems, before
    out/ exists (not by build_loggers once out/ is written)."""
    if failure == "ModuleNotFoundError":
        monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # what `import` sees: not there
    else:
        monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
        monkeypatch.setattr(sys, "meta_path", [_BrokenOnImport(), *sys.meta_path])
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        train(out=out, loggers={"tensorboard": {"enabled": enabled}}, **tiny_lm(batch_size=7, gradient_accumulation_steps=2))
    problems = err.value.problems
    assert len(problems) == 2 and problems[0].startswith("batch_size: 7"), "listed with the others"
    tb = problems[1]
    assert tb.startswith(f"loggers.tensorboard.enabled: {'true' if enabled is True else 'auto'}")
    assert f"torch.utils.tensorboard fails to import ({failure}:" in tb
    assert 'pip install "stabletrain[tensorboard]"' in tb and "loggers.tensorboard.enabled=false" in tb
    assert not out.exists(), "reported before anything is written"
