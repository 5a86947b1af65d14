"""Self-healing past recurring bad samples: quarantine with evidence, one capture folder per recovery,
what the recovery-limit stop says, and diagnose finding recovery captures (issue 25, items 5, 6, 7, 13)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from nan_models import PoisonData, PoisonNet

import stabletrain
from stabletrain import RecoveryLimitError
from stabletrain.data.loader import ResumableBatchSampler
from stabletrain.debug.nan_capture import NaNCaptureError, capture_files, recovery_captures
from stabletrain.safety.quarantine import isolate_samples, read_quarantine

BAD = (37, 301)


def _events(out: Path, kind: str = "recovery") -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if f'"event": "{kind}"' in line]


def _run(out: Path, policy: str, data=None, steps: int = 120, **more):
    """The issue's run: 512 samples, batch 16; samples 37 and 301 hold a NaN every epoch."""
    args = dict(
        out=out, model=PoisonNet(), steps=steps, batch_size=16, num_workers=0,
        data=data if data is not None else PoisonData(n=512, input_poison={i: float("nan") for i in BAD}),
        log_every_num_steps=1, checkpoint_every_num_steps=10, trend_alerts={"enabled": False},
        model_args={"lr": 0.01, "warmup_steps": 0},
    )
    args["on_instability"] = {"policy": policy, **more.pop("on_instability", {})}
    args.update(more)
    return stabletrain.train(**args)


class _Seen:
    def __init__(self):
        self.samples: set[int] = set()

    def on_microbatch(self, trainer, *, step, micro_step, batch, indices):
        self.samples.update(int(i) for i in indices.tolist())


def test_quarantine_replaces_samples_in_place_and_keeps_the_epoch_length():
    plain = ResumableBatchSampler(64, 8, seed=0).epoch_batches(1)
    q = ResumableBatchSampler(64, 8, seed=0, exclude=[plain[2][3], plain[5][0]]).epoch_batches(1)
    assert len(q) == len(plain) == 8
    flat_p, flat_q = sum(plain, []), sum(q, [])
    changed = [k for k, (a, b) in enumerate(zip(flat_p, flat_q)) if a != b]
    assert changed == [2 * 8 + 3, 5 * 8 + 0], "only the quarantined samples' places change"
    assert plain[2][3] not in flat_q and plain[5][0] not in flat_q
    assert [flat_q[k] for k in changed] == flat_p[:2], "filled by the epoch's first kept samples"
    with pytest.raises(ValueError, match="every one of the 16 samples is quarantined"):
        ResumableBatchSampler(16, 8, seed=0, exclude=range(16)).epoch_batches(0)


@pytest.mark.parametrize("policy", ["rollback", "skip_step"])
def test_a_recurring_bad_sample_is_quarantined_with_evidence_and_the_run_finishes(tmp_path, policy):
    """On main, rollback returned to a snapshot at each NaN, the samples came back every epoch and the
    run never advanced: here each sample costs one skipped step, then the loader keeps it out."""
    out = tmp_path / policy
    seen = _Seen()
    result = _run(out, policy, callbacks=[seen])
    assert result.steps_done == 120
    rows = _events(out)
    assert sorted(i for r in rows for i in r["culprits"]) == list(BAD)
    assert len(rows) == 2 and all(r["action"] == "skip_step" and "rolled_back_to" not in r for r in rows)
    assert all(r["quarantined"] == r["culprits"] for r in rows)
    q = read_quarantine(out)
    assert [e["index"] for e in q] == list(BAD)
    for e in q:
        row = next(r for r in rows if e["index"] in r["culprits"])
        assert e["how"] == "input" and e["field"] == "batch['x']" and e["count"] == 1
        assert e["step"] == row["step"] and e["trigger"] == "nonfinite_loss" and e["step_loss"] == "nan"
        assert Path(e["capture"]).is_file() and e["capture"] == row["capture"]
    # 120 steps are 3.75 epochs: each sample was loaded once, in the step that found it.
    assert seen.samples >= set(BAD)
    log = (out / "train.log").read_text()
    assert f"culprit sample(s) {rows[0]['culprits'][0]}: batch['x'] holds 1 non-finite value(s); quarantined" in log
    # Listed in the report.
    stabletrain.report(out, quiet=True)
    md = (out / "report" / "summary.md").read_text()
    assert "## Quarantined samples" in md
    for e in q:
        assert f"| {e['index']} | {e['step']} | nonfinite_loss | batch['x'] holds 1 non-finite value(s) |" in md


def test_the_quarantine_holds_after_a_resume(tmp_path):
    out = tmp_path / "run"
    _run(out, "skip_step", steps=40)
    assert [e["index"] for e in read_quarantine(out)] == list(BAD)
    seen = _Seen()
    _run(out, "skip_step", steps=120, resume_interrupted=True, callbacks=[seen])
    assert not set(BAD) & seen.samples, "quarantined samples are never loaded after the resume"
    assert len(_events(out)) == 2, "no new recovery: the samples did not come back"
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    assert [e["index"] for e in ckpt["callbacks"]["on_instability"]["quarantine"]] == list(BAD)


def test_a_failure_no_sample_explains_quarantines_nothing_and_the_stop_blames_the_updates(tmp_path):
    """SGD at lr=30: spikes one after another, on different batches, no sample to blame: the lr."""
    out = tmp_path / "run"
    with pytest.raises(RecoveryLimitError) as info:
        _run(out, "skip_step", data=PoisonData(n=512), steps=30,
             model_args={"lr": 30.0, "warmup_steps": 0, "optimizer": "sgd"},
             on_instability={"max_recoveries": 2, "warmup": 5})
    rows = _events(out)
    assert len(rows) == 3 and all(r["culprits"] == [] for r in rows) and read_quarantine(out) == []
    text = str(info.value)
    assert "Cause: the updates, not the data: the last 3 recoveries (loss_spike) came one after another" in text
    assert "lower the learning rate: model_args.lr=" in text and "SGD's update is lr x gradient" in text
    assert "Cause: bad data" not in text
    # The promised diagnosis ran, and the command changes the lr.
    assert all((Path(r["capture"]).parent / "diagnosis.json").is_file() for r in rows)
    command = text.split("overwrite=true: ")[1].split("\n")[0]
    assert "model_args.lr=3.0" in command, "a tenth of the run's own SGD lr, not AdamW's default"


def test_update_size_advice_follows_the_optimizer():
    from stabletrain.safety.recovery_stop import update_size_advice

    p = [torch.nn.Parameter(torch.zeros(1))]
    adam = update_size_advice(torch.optim.AdamW(p), "model_args.lr=0.001", 0.0)
    assert "AdamW's update is about lr in size whatever the gradient, so clipping gradients does not bound it" in adam
    assert "gradient_clip_val=1.0" not in adam
    sgd = update_size_advice(torch.optim.SGD(p, lr=1.0), "model_args.lr=0.1", 0.0)
    assert "clipping (gradient_clip_val=1.0) also bounds it" in sgd
    assert "clipping" not in update_size_advice(torch.optim.SGD(p, lr=1.0), "model_args.lr=0.1", 1.0)
    assert update_size_advice(torch.optim.Adagrad(p), "x", 0.0).startswith("lower the learning rate of Adagrad")


def _big_target(index: int) -> PoisonData:
    data = PoisonData(n=512)
    data.y[index] = 3e38  # finite, but its squared error is Inf
    return data


def test_isolate_samples_by_replay_when_the_input_is_finite(tmp_path):
    """A sample whose input is finite but overflows the forward pass (Inf loss) is found by replaying."""
    out = tmp_path / "run"
    step = 3
    from nan_models import samples_of_step

    culprit = samples_of_step(step, n=512, batch_size=16)[5]
    with pytest.raises(RecoveryLimitError):
        _run(out, "skip_step", data=_big_target(culprit), steps=10,
             on_instability={"max_recoveries": 0})
    row = _events(out)[0]
    found = isolate_samples(Path(row["capture"]).parent, model=PoisonNet())
    assert [e["index"] for e in found] == [culprit] and found[0]["how"] == "replay"
    assert row["culprits"] == [culprit]


def test_a_sample_with_nan_in_two_fields_names_each_with_its_count(tmp_path):
    """Its input and its target each hold a NaN: the evidence names both fields, not the first with
    the sum."""
    out = tmp_path / "run"
    from nan_models import samples_of_step

    culprit = samples_of_step(3, n=512, batch_size=16)[5]
    data = PoisonData(n=512, input_poison={culprit: float("nan")})
    data.y[culprit] = float("nan")
    with pytest.raises(RecoveryLimitError):
        _run(out, "skip_step", data=data, steps=10, on_instability={"max_recoveries": 0})
    found = isolate_samples(Path(_events(out)[0]["capture"]).parent, model=PoisonNet())
    assert [(e["index"], e["how"], e["field"], e["count"]) for e in found] == [(culprit, "input", "batch['x']", 2)]
    assert found[0]["evidence"] == ("batch['x'] holds 1 non-finite value(s), batch['y'] holds 1 non-finite value(s)")


def test_the_recovery_limit_stop_names_the_data_and_a_command_that_skips_it(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RecoveryLimitError) as info:
        _run(out, "skip_step", on_instability={"max_recoveries": 1})
    text = str(info.value)
    rows = _events(out)
    assert len(rows) == 2 and rows[-1]["action"] == "stop"
    assert "after 1 recoveries (on_instability.max_recoveries): stopping" in text
    assert f"Cause: bad data. The samples of step {rows[-1]['step']} were isolated" in text
    assert "quarantine.json" in text and "a resume skips them" in text
    assert "Continue from it: stabletrain" in text or "resume_interrupted=true" in text
    assert "model_args.lr" not in text, "the data, not the lr"
    assert all((Path(r["capture"]).parent / "diagnosis.json").is_file() for r in rows)


def test_one_capture_folder_per_recovery_and_diagnose_finds_them(tmp_path, capsys):
    """Two spikes meet the same step number after a rollback to step 0: two folders, each row its own."""
    from nan_models import samples_of_step

    data = PoisonData(n=512)
    for batch in (12, 25):  # after the rollback at step 12 to 0, step 12 is batch 25
        data.y[samples_of_step(batch, n=512, batch_size=16)[0]] = 1e4
    out = tmp_path / "run"
    _run(out, "rollback", data=data, steps=20, checkpoint_every_num_steps=100,
         on_instability={"warmup": 5, "rollback_steps": 100})
    rows = _events(out)
    assert [(r["step"], r["action"]) for r in rows][:2] == [(12, "rollback"), (12, "rollback")]
    folders = [Path(r["capture"]).parent.parent.name for r in rows]
    assert folders[:2] == ["step12", "step12_r2"] and len(set(folders)) == len(rows)
    assert [torch.load(r["capture"], weights_only=True)["recovery"]["loss"] for r in rows] == [
        r["loss"] for r in rows]
    log = (out / "train.log").read_text()
    assert ("rolled back to step 0 for the 2nd time (the state of that snapshot keeps leading to bad steps), "
            "13 step(s) of data skipped; recovery 2 of at most 10: step 12 again, on other batches") in log
    # diagnose on the run folder: the recovery captures, newest first in line.
    assert recovery_captures(out) == [out / "debug" / "recoveries" / f for f in folders]
    assert capture_files(out) == [out / "debug" / "recoveries" / folders[-1] / "rank0" / "nan_capture.pt"]
    # A user's own model: the hint names the file training named, not path/to/file.py.
    with pytest.raises(NaNCaptureError) as info:
        stabletrain.load_nan_capture(out).get_model()
    models = str(Path(__file__).resolve().parents[1] / "debug" / "nan_models.py")
    assert f"--model {models}:PoisonNet" in str(info.value) and "path/to/file.py" not in str(info.value)


def test_cli_diagnose_on_a_run_folder_lists_the_recovery_captures(tmp_path, capsys):
    from stabletrain.cli import diagnose as cli_diagnose

    out = tmp_path / "run"
    _run(out, "skip_step", steps=30)
    capsys.readouterr()
    models = str(Path(__file__).resolve().parents[1] / "debug" / "nan_models.py")
    assert cli_diagnose.run([str(out), "--model", f"{models}:PoisonNet", "--no-write"]) == 0
    got = capsys.readouterr()
    assert "Recovery captures in" in got.err and "step18, step27" in got.err and "Diagnosing the newest, step27" in got.err
    assert "no NaN capture" not in got.out + got.err and "sample 37" in got.out
    shutil.rmtree(out / "debug" / "recoveries")
    with pytest.raises(NaNCaptureError, match="debug/recoveries/"):
        capture_files(out)


@pytest.mark.parametrize("policy", ["stop", "skip_step"])
def test_every_resume_honours_the_quarantine_and_says_so(tmp_path, capsys, policy):
    """A resume with the default ``stop`` policy did not read quarantine.json: the NaN samples came
    back in the next epoch and the guard stopped the run. Every resume keeps them out, on the console."""
    out = tmp_path / "run"
    _run(out, "skip_step", steps=40)
    assert [e["index"] for e in read_quarantine(out)] == list(BAD)
    capsys.readouterr()
    seen = _Seen()
    result = _run(out, policy, steps=120, resume_interrupted=True, callbacks=[seen])
    assert result.steps_done == 120
    assert not set(BAD) & seen.samples, "quarantined samples are never loaded after the resume"
    assert len(_events(out)) == 2
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("Quarantine: "))
    assert line.startswith(f"Quarantine: 2 sample(s) found bad earlier in this run stay out of training (listed in "
                           f"{out / 'quarantine.json'}): 37 (step ")
    assert "batch['x'] holds 1 non-finite value(s)" in line and ", 301 (step " in line


def test_a_quarantine_file_that_cannot_be_read_is_a_config_error(tmp_path):
    out = tmp_path / "run"
    _run(out, "skip_step", steps=20)
    (out / "quarantine.json").write_text('{"samples": [{"step": 3}]}')
    with pytest.raises(stabletrain.ConfigError, match="quarantine.json: cannot read the quarantined samples"):
        _run(out, "stop", steps=40, resume_interrupted=True)
