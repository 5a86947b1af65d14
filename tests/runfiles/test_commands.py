"""Commands printed in messages work when pasted: absolute, quoted paths, the run's own settings."""

from __future__ import annotations

import shlex

from stabletrain.config import load_settings
from stabletrain.runfiles.commands import set_cli_invocation, train_command


def test_a_command_from_settings_has_absolute_quoted_paths_and_only_the_changed_settings(tmp_path):
    out = tmp_path / "my runs" / "it's here"
    settings = load_settings({"out": out, "steps": 40, "model_args": {"lr": 3.0, "betas": [0.8, 0.9]},
                              "overwrite": True})
    command = train_command(settings, resume_from=out / "checkpoints" / "step_000004.ckpt",
                            extra={"model_args.lr": 0.6})
    args = shlex.split(command)
    assert args[:3] == ["stabletrain", "train", f"out={out.resolve()}"]
    assert "steps=40" in args and "model_args.betas=[0.8, 0.9]" in args and "model_args.lr=0.6" in args
    assert "model_args.lr=3.0" not in args, "the extra setting replaces the run's"
    checkpoint = (out / "checkpoints" / "step_000004.ckpt").resolve()
    assert "overwrite=true" not in args and args[-2] == f"resume_from={checkpoint}"


def test_a_command_from_the_cli_keeps_its_arguments_and_replaces_how_it_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    set_cli_invocation(["out=rel/run", "steps=60", "model_args.lr=1e3", "overwrite=true"])
    try:
        settings = load_settings({"out": "rel/run", "steps": 60, "model_args": {"lr": 1e3}, "overwrite": True})
        args = shlex.split(train_command(settings, resume_interrupted=True))
    finally:
        set_cli_invocation(None)
    assert args == ["stabletrain", "train", f"out={tmp_path / 'rel' / 'run'}", "steps=60", "model_args.lr=1e3",
                    "resume_interrupted=true"]


def test_own_python_objects_give_the_python_call(tmp_path):
    from torch import nn

    class Model(nn.Linear):
        def training_step(self, batch):
            return self(batch).sum()

    settings = load_settings({"out": tmp_path / "run", "model": Model(2, 1)})
    text = train_command(settings, overwrite=True)
    assert text.startswith(f"stabletrain.train(out={str((tmp_path / 'run').resolve())!r}, ... your other settings ...")
    assert "overwrite=True" in text
