"""A full disk, a read-only folder: one clear message, no traceback, a non-zero exit, the last
checkpoint intact, no temporary file left, and the resume after freeing space continues bitwise.
The failures are injected at the writer (no mount needed)."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stabletrain.utils.io as io_mod
from conftest import cli_env
from stabletrain.cli.main import main
from stabletrain.loggers.jsonl import JsonlLogger
from stabletrain.runfiles.checkpoint import load_checkpoint
from stabletrain.safety.write_failures import WriteFailedError
from stabletrain.training.loop import train

TINY = [
    "model_args.n_layers=1", "model_args.n_heads=2", "model_args.dim=32", "model_args.context_length=16",
    "model_args.dropout=0.0", "model_args.warmup_steps=2", "batch_size=8", "log_every_num_steps=1",
    "loggers.tensorboard.enabled=false",
]


class FullDiskAt:
    """The ``k``-th checkpoint file written (1-based) fails with ENOSPC after ``after`` bytes, as
    a write on a full disk does; every later one too."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, k: int, after: int = 4096):
        self.k, self.after, self.opened = k, after, 0
        original = io_mod._Writes.__init__
        disk = self

        class Failing:
            def __init__(self, f):
                self.f, self.written = f, 0

            def write(self, data):
                if self.written + len(data) > disk.after:
                    raise OSError(errno.ENOSPC, "No space left on device")
                self.written += len(data)
                return self.f.write(data)

            def flush(self):
                self.f.flush()

        def init(writes, f):
            original(writes, f)
            disk.opened += 1
            if disk.opened >= disk.k:
                writes.f = Failing(f)

        monkeypatch.setattr(io_mod._Writes, "__init__", init)


def _train(out: Path, *extra: str) -> int:
    return main(["train", f"out={out}", *TINY, *extra])


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(out / "checkpoints" / "last.ckpt")["model"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("write_failures") / "reference"
    assert _train(out, "steps=12", "checkpoint_every_num_steps=4") == 0
    return out


def test_full_disk_during_checkpoint(tmp_path, monkeypatch, capsys, reference):
    out = tmp_path / "full"
    with monkeypatch.context() as patch:
        FullDiskAt(patch, k=2)  # step_000004.ckpt is written; step_000008.ckpt meets the full disk
        code = _train(out, "steps=12", "checkpoint_every_num_steps=4")
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback" not in err and "inline_container" not in err
    target = out / "checkpoints" / "step_000008.ckpt"
    assert err.count("\n") == 1  # one message
    assert f"Could not write {target}: no space left on device (ENOSPC). Training stopped after 8 steps." in err
    last = out / "checkpoints" / "last.ckpt"
    assert f"{last} holds the healthy state from before step 4" in err
    assert "Free space on that filesystem (df -h" in err
    assert f"stabletrain train out={out}" in err and "resume_interrupted=true" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last.ckpt", "step_000004.ckpt"]  # no .tmp
    assert load_checkpoint(last)["step"] == 4
    assert "WriteFailedError: Could not write" in (out / "train.log").read_text()

    # Space freed: the printed resume continues, and ends with the weights of the uninterrupted run.
    assert _train(out, "steps=12", "checkpoint_every_num_steps=4", "resume_interrupted=true") == 0
    ref, got = _weights(reference), _weights(out)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_checkpoint_that_will_not_fit_is_not_started(tmp_path, monkeypatch):
    calls = []

    def free(folder):
        calls.append(folder)
        return 10**12 if len(calls) == 1 else 300_000  # room for the first checkpoint only

    monkeypatch.setattr(io_mod, "free_bytes", free)
    out = tmp_path / "tight"
    with pytest.raises(WriteFailedError) as err:
        train(out=out, steps=6, checkpoint_every_num_steps=2, batch_size=8, log_every_num_steps=1,
              model_args={"n_layers": 1, "n_heads": 2, "dim": 32, "context_length": 16, "warmup_steps": 1})
    e = err.value
    assert e.errno == errno.ENOSPC and e.step == 4 and e.path == out / "checkpoints" / "step_000004.ckpt"
    assert e.checkpoint == out / "checkpoints" / "step_000002.ckpt"
    assert "not enough free space for the checkpoint (" in str(e) and "MiB needed, 0.3 MiB free)" in str(e)
    assert f"{out / 'checkpoints' / 'last.ckpt'} holds the healthy state from before step 2" in str(e)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last.ckpt", "step_000002.ckpt"]
    assert load_checkpoint(out / "checkpoints" / "last.ckpt")["step"] == 2


def test_metrics_write_fails(tmp_path, monkeypatch):
    original = JsonlLogger._write

    def write(self, obj):
        if obj.get("step") == 3 and "event" not in obj:
            self._f.write('{"step": 3, "lo')  # what reached the disk before it filled
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        original(self, obj)

    monkeypatch.setattr(JsonlLogger, "_write", write)
    out = tmp_path / "metrics_full"
    with pytest.raises(WriteFailedError) as err:
        train(out=out, steps=8, checkpoint_every_num_steps=2, batch_size=8, log_every_num_steps=1,
              model_args={"n_layers": 1, "n_heads": 2, "dim": 32, "context_length": 16, "warmup_steps": 1})
    e = err.value
    assert e.path == out / "metrics.jsonl" and e.step == 4  # the step that failed to log finished
    assert str(e).startswith(f"Could not write {out / 'metrics.jsonl'}: no space left on device (ENOSPC). "
                             "Training stopped after 4 steps.")
    assert e.checkpoint is not None and load_checkpoint(e.checkpoint)["step"] == 2
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last.ckpt", "step_000002.ckpt"]


@pytest.mark.parametrize("code, words", [(errno.EROFS, "the filesystem is read-only (EROFS)"),
                                         (errno.ENOENT, "its folder no longer exists (ENOENT)")])
def test_read_only_or_vanished_folder(tmp_path, monkeypatch, code, words):
    real = io_mod.tempfile.mkstemp
    made = []

    def mkstemp(*args, **kwargs):
        made.append(1)
        if len(made) > 1:
            raise OSError(code, "refused", kwargs.get("dir"))
        return real(*args, **kwargs)

    monkeypatch.setattr(io_mod.tempfile, "mkstemp", mkstemp)
    out = tmp_path / "ro"
    with pytest.raises(WriteFailedError) as err:
        train(out=out, steps=4, checkpoint_every_num_steps=2, batch_size=8,
              model_args={"n_layers": 1, "n_heads": 2, "dim": 32, "context_length": 16, "warmup_steps": 1})
    assert f": {words}. Training stopped after" in str(err.value)
    assert err.value.errno == code


DDP_FULL_DISK = """import errno, sys
import stabletrain.utils.io as io_mod
from stabletrain.loggers.jsonl import JsonlLogger
from stabletrain.cli.main import main

where = sys.argv[1]
if where == "checkpoint":
    original = io_mod._Writes.__init__
    count = [0]

    class Failing:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            self.f.flush()

    def init(writes, f):
        original(writes, f)
        count[0] += 1
        if count[0] >= 2:
            writes.f = Failing(f)

    io_mod._Writes.__init__ = init
else:
    original_write = JsonlLogger._write

    def write(self, obj):
        if obj.get("step") == 3 and "event" not in obj:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        original_write(self, obj)

    JsonlLogger._write = write
sys.exit(main(["train", f"out=run_{where}", "devices=2", "strategy=ddp", "accelerator=cpu", "steps=8",
               "batch_size=8", "log_every_num_steps=1", "checkpoint_every_num_steps=2", "model_args.n_layers=1",
               "model_args.dim=32", "model_args.n_heads=2", "model_args.context_length=16",
               "loggers.tensorboard.enabled=false"]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("where, target", [("checkpoint", "checkpoints/step_000004.ckpt"), ("metrics", "metrics.jsonl")])
def test_ddp_every_rank_stops_together_with_one_message(tmp_path, where, target):
    """Rank 0's write fails (a checkpoint, or metrics.jsonl); both ranks stop after the same
    step, without a hang, and only the failing rank's message is printed."""
    (tmp_path / "full.py").write_text(DDP_FULL_DISK)
    run = subprocess.run([sys.executable, "full.py", where], cwd=tmp_path, env=cli_env(), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 1
    messages = [line for line in run.stderr.splitlines() if line.startswith("stabletrain train:")]
    assert len(messages) == 1, run.stderr[-3000:]
    assert messages[0].startswith(f"stabletrain train: WriteFailedError: Could not write run_{where}/{target}: "
                                  "no space left on device (ENOSPC). Training stopped after 4 steps.")
    assert "resume_interrupted=true" in messages[0]
    out = tmp_path / f"run_{where}"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last.ckpt", "step_000002.ckpt"]
    assert load_checkpoint(out / "checkpoints" / "last.ckpt")["step"] == 2


def test_report_on_a_full_disk_says_what_and_exits_1(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    (out).mkdir()
    (out / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 2.0, "gradient_norm": 1.0, "lr": 0.001}}\n'
                                               for s in range(20)))
    summary = out / "report" / "summary.md"
    real = Path.write_text

    def write_text(self, *args, **kwargs):
        if self == summary:
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    assert main(["report", str(out), "--no-plots"]) == 1
    err = capsys.readouterr().err
    assert err == (f"stabletrain report: could not write {summary}: no space left on device (ENOSPC). Free space on "
                   f"that filesystem (df -h {summary.parent} shows it), then run the command again.\n")
