"""What self-healing says and keeps for each recovery (docs/self_healing.md, "Evidence for every
recovery"): the console line ``Recovered step N: ...``, the capture folder and file, the
diagnosis lines after training, the RecoveryLimitError.

The Healer runs in-process against a small stub of the trainer (a real model, optimizer,
guard and capture monitor; the console, the event log and the loader recorded), so that each
wording and each path is checked on its own, in well under a second.
"""

from __future__ import annotations

import json
import math
import pickle
import types
from pathlib import Path
from typing import Any

import torch
from healer_steps import Net, train_step

import stabletrain.debug.diagnose as diagnose_mod
from stabletrain import RecoveryLimitError
from stabletrain.config import load_settings
from stabletrain.debug.nan_capture.commands import default_replay_command
from stabletrain.safety.healing import Healer, _few, _flat, _ordinal, row_value
from stabletrain.safety.instability_guard import Recovery
from stabletrain.utils.rng import get_rng_state


class _Trainer:
    """What the Healer reads of its trainer; console lines, event rows and loader rebuilds recorded."""

    def __init__(self, tmp_path: Path, policy: str = "skip_step", *, task: str = "custom", world_size: int = 1,
                 **on_instability: Any):
        torch.manual_seed(0)
        self.out = tmp_path / "run"
        self.settings = load_settings({"out": self.out, "on_instability": {"policy": policy, **on_instability}})
        self.task_name = task
        self.task = types.SimpleNamespace(model_meta={})
        self.model = Net()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scaler = None
        self.precision = "32-true"
        self.rank, self.world_size, self.sharded = 0, world_size, False
        self.is_rank_zero = True
        # Under DDP the other rank's loss is taken to be this rank's: the mean is this rank's loss.
        self.fabric = types.SimpleNamespace(device=torch.device("cpu"), all_reduce=lambda t, reduce_op: t)
        self.step = 0
        self.microbatches_consumed = 0
        self.lines: list[str] = []
        self.console = types.SimpleNamespace(info=self.lines.append)
        self.events: list[dict] = []
        self.safety = types.SimpleNamespace(health=types.SimpleNamespace(
            note_recovery=lambda step, trigger: None, spike_open=False))
        self.quarantined: frozenset = frozenset()
        self.loaders_built = 0

    def resolved_settings(self) -> dict[str, Any]:
        return {"task": self.task_name}

    def log_event(self, row: dict) -> None:
        self.events.append(row)

    def build_loader(self) -> None:
        self.loaders_built += 1

    def checkpoint_state(self, on_cpu: bool = True, layout: Any = None) -> dict[str, Any]:
        return {"step": self.step, "model": {k: v.clone() for k, v in self.model.state_dict().items()},
                "optimizer": pickle.loads(pickle.dumps(self.optimizer.state_dict())),
                "rng": [get_rng_state()], "callbacks": {}}

    def recoveries(self) -> list[dict]:
        return [e for e in self.events if e.get("event") == "recovery"]


def _healer(tmp_path: Path, policy: str = "skip_step", **kw: Any) -> tuple[_Trainer, Healer]:
    t = _Trainer(tmp_path, policy, **kw)
    h = Healer(t)
    h.on_train_start(t)
    return t, h


def _batch(indices: list[int], nan: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """Samples ``indices``; those in ``nan`` hold a NaN in their input."""
    g = torch.Generator().manual_seed(sum(indices))
    x = torch.randn(len(indices), 4, generator=g)
    for i in nan:
        x[indices.index(i), 1] = math.nan
    return {"x": x, "y": torch.randn(len(indices), 1, generator=g)}


def _step(t: _Trainer, h: Healer, step: int, indices: list[int], nan: tuple[int, ...] = ()) -> None:
    """One training step through the healer's hooks, as the trainer calls them (one microbatch)."""
    train_step(t, h, step, _batch(indices, nan), indices, t.model.training_step)


def _spike(h: Healer, step: int, samples: list[int], trigger: str = "loss_spike") -> None:
    """The guard's verdict on ``step``: a spike (finite values), handled as end_of_step handles one."""
    h._handle([Recovery(step=step, trigger=trigger, zscore=9.5, ratio=3.0, loss=40.0, gradient_norm=7.0,
                        action=h.policy, samples=samples, description=f"{trigger} (z=9.5)")])


def _line(t: _Trainer, step: int) -> str:
    (line,) = [x for x in t.lines if x.startswith(f"Recovered step {step}:")]
    return line


def _capture_file(path: str) -> dict[str, Any]:
    return torch.load(path, weights_only=False)


def _steps(t: _Trainer, h: Healer, steps: range, first_sample: int = 0) -> None:
    for s in steps:
        _step(t, h, s, [first_sample + 4 * s + i for i in range(4)])


# ---------------------------------------------------------------------- the console line, skip_step


def test_a_nan_step_names_its_culprit_marks_its_data_and_keeps_a_capture(tmp_path):
    t, h = _healer(tmp_path)
    _steps(t, h, range(3))
    _step(t, h, 3, [12, 13, 14, 15], nan=(14,))
    folder = t.out / "debug" / "recoveries" / "step3"
    assert _line(t, 3) == (
        "Recovered step 3: nonfinite_loss; update skipped; culprit sample(s) 14: batch['x'] holds 1 non-finite "
        "value(s); quarantined; samples [14 (NaN/Inf in its data), 12, 13, 15]; "
        f"capture: {folder / 'rank0' / 'nan_capture.pt'}")
    (row,) = t.recoveries()
    assert row["capture"] == str(folder / "rank0" / "nan_capture.pt")
    # The capture: the trigger's reason, a replay command for this rank's folder and this model (your
    # own: named by --model), and the recovery's values.
    cap = _capture_file(row["capture"])
    assert cap["step"] == 3 and cap["reason"] == "nonfinite_loss"
    assert cap["replay_command"] == default_replay_command(folder / "rank0", model=t.model)
    assert cap["replay_command"].startswith(f"stabletrain replay {folder / 'rank0'} --model ")
    assert cap["replay_command"].endswith("healer_steps.py:Net")
    recovery = cap["recovery"]
    assert recovery["trigger"] == "nonfinite_loss" and recovery["action"] == "skip_step"
    assert [math.isnan(recovery[k]) for k in ("zscore", "ratio", "loss", "gradient_norm")] == [True] * 4
    # quarantine.json holds the step's non-finite loss and gradient norm as JSON strings.
    (entry,) = json.loads((t.out / "quarantine.json").read_text())["samples"]
    assert (entry["index"], entry["step_loss"], entry["step_gradient_norm"]) == (14, "nan", "nan")


def test_a_culprit_found_again_is_already_quarantined_and_four_are_named_at_most(tmp_path):
    t, h = _healer(tmp_path)
    h.quarantine.add([{"index": 2, "how": "input", "field": "batch['x']", "count": 1, "evidence": "earlier"}])
    _step(t, h, 0, [0, 1, 2, 3], nan=(2,))
    assert "culprit sample(s) 2: batch['x'] holds 1 non-finite value(s); already quarantined; samples [2 (NaN" in (
        _line(t, 0))
    # Five culprits: four named with their evidence, all five first in the samples, marked.
    _step(t, h, 1, [10, 11, 12, 13, 14, 15], nan=(10, 11, 12, 13, 14))
    evidence = "batch['x'] holds 1 non-finite value(s)"
    marked = ", ".join(f"{i} (NaN/Inf in its data)" for i in (10, 11, 12, 13, 14))
    assert f"culprit sample(s) {'; '.join(f'{i}: {evidence}' for i in (10, 11, 12, 13))}; quarantined; " \
           f"samples [{marked}, 15]; capture: " in _line(t, 1)
    assert t.recoveries()[1]["culprits"] == [10, 11, 12, 13, 14]


def test_a_spike_under_skip_step_says_update_skipped_and_names_no_culprit(tmp_path):
    t, h = _healer(tmp_path)
    _steps(t, h, range(6))
    _spike(h, 5, [20, 21, 22, 23])
    folder = t.out / "debug" / "recoveries" / "step5"
    assert _line(t, 5) == ("Recovered step 5: loss_spike (z=9.5); update skipped; samples [20, 21, 22, 23]; "
                           f"capture: {folder / 'rank0' / 'nan_capture.pt'}")
    cap = _capture_file(t.recoveries()[0]["capture"])
    assert cap["reason"] == "loss_spike"
    assert cap["recovery"] == {"trigger": "loss_spike", "zscore": 9.5, "ratio": 3.0, "loss": 40.0,
                               "gradient_norm": 7.0, "action": "skip_step"}


def test_a_nonfinite_gradient_capture_has_the_reason_replay_knows(tmp_path):
    t, h = _healer(tmp_path)
    _steps(t, h, range(2))
    h._handle([Recovery(step=1, trigger="nonfinite_grad", zscore=math.nan, ratio=math.nan, loss=0.5,
                        gradient_norm=math.inf, action="skip_step", samples=[4, 5, 6, 7],
                        description="nonfinite_grad")])
    cap = _capture_file(t.recoveries()[0]["capture"])
    assert cap["reason"] == "nonfinite_gradients"
    assert cap["recovery"]["trigger"] == "nonfinite_grad" and cap["recovery"]["gradient_norm"] == math.inf


def test_a_built_in_model_s_capture_replays_from_its_settings(tmp_path):
    t, h = _healer(tmp_path, task="lm")
    _steps(t, h, range(2))
    _spike(h, 1, [4, 5, 6, 7])
    folder = t.out / "debug" / "recoveries" / "step1" / "rank0"
    assert _capture_file(t.recoveries()[0]["capture"])["replay_command"] == f"stabletrain replay {folder}"


def test_a_verdict_read_after_its_step_has_no_capture_and_marks_no_sample(tmp_path):
    """The batches held are the next step's: no capture, and no sample marked from another step's data
    (sample 30 is in both steps; its NaN is in the next step's batch)."""
    t, h = _healer(tmp_path)
    _step(t, h, 6, [28, 29, 30, 31])
    h.on_step_start(t, step=7)
    h.on_microbatch(t, step=7, micro_step=0, batch=_batch([30, 40], nan=(30,)), indices=torch.tensor([30, 40]))
    _spike(h, 6, [28, 29, 30, 31])
    assert _line(t, 6) == "Recovered step 6: loss_spike (z=9.5); update skipped; samples [28, 29, 30, 31]"
    assert t.recoveries()[0]["capture"] is None
    assert not (t.out / "debug" / "recoveries").exists()


def test_under_ddp_the_line_has_every_rank_s_samples_and_the_capture_replays_the_ranks_folder(tmp_path, monkeypatch):
    """Rank 0 of 2: the collectives bring the other rank's culprits, samples and samples with bad data."""
    import torch.distributed as dist

    other = [[{"index": 107, "how": "input", "field": "batch['x']", "count": 1,
               "evidence": "batch['x'] holds 1 non-finite value(s)"}], [104, 105, 106, 107], [107]]

    def all_gather_object(out, obj):
        out[0], out[1] = obj, other.pop(0)

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    t, h = _healer(tmp_path, world_size=2)
    _step(t, h, 3, [12, 13, 14, 15], nan=(14,))
    folder = t.out / "debug" / "recoveries" / "step3"
    assert _line(t, 3) == (
        "Recovered step 3: nonfinite_loss; update skipped; culprit sample(s) 14: batch['x'] holds 1 non-finite "
        "value(s); 107: batch['x'] holds 1 non-finite value(s); quarantined; samples [14 (NaN/Inf in its data), "
        f"107 (NaN/Inf in its data), 12, 13, 15, 104, 105, 106]; capture: {folder / 'rank0' / 'nan_capture.pt'}")
    assert not other, "three exchanges: the culprits, the samples, the samples with bad data"
    cap = _capture_file(t.recoveries()[0]["capture"])
    assert cap["replay_command"] == default_replay_command(folder, model=t.model)
    assert cap["replay_command"].startswith(f"stabletrain replay {folder} --model ")


# ---------------------------------------------------------------------- rollback


def test_rollback_lines_say_how_often_a_snapshot_was_returned_to_and_which_step_came_back(tmp_path):
    t, h = _healer(tmp_path, "rollback")
    _steps(t, h, range(5))
    _spike(h, 4, [16, 17, 18, 19])
    rec = t.out / "debug" / "recoveries"
    assert _line(t, 4) == ("Recovered step 4: loss_spike (z=9.5); rolled back to step 0, 5 step(s) of data skipped; "
                           f"samples [16, 17, 18, 19]; capture: {rec / 'step4' / 'rank0' / 'nan_capture.pt'}")
    t.lines.clear()
    _steps(t, h, range(3), first_sample=100)
    _spike(h, 2, [108, 109, 110, 111])
    assert _line(t, 2) == (
        "Recovered step 2: loss_spike (z=9.5); rolled back to step 0 for the 2nd time (the state of that snapshot "
        "keeps leading to bad steps), 3 step(s) of data skipped; samples [108, 109, 110, 111]; "
        f"capture: {rec / 'step2' / 'rank0' / 'nan_capture.pt'}")
    t.lines.clear()
    _steps(t, h, range(3), first_sample=200)
    _spike(h, 2, [208, 209, 210, 211])
    assert _line(t, 2) == (
        "Recovered step 2: loss_spike (z=9.5); rolled back to step 0 for the 3rd time (the state of that snapshot "
        "keeps leading to bad steps), 3 step(s) of data skipped; recovery 3 of at most 10: step 2 again, on other "
        "batches (the data since the snapshot is not re-run); samples [208, 209, 210, 211]; "
        f"capture: {rec / 'step2_r2' / 'rank0' / 'nan_capture.pt'}")
    t.lines.clear()
    _steps(t, h, range(5), first_sample=300)
    _spike(h, 4, [316, 317, 318, 319])
    assert "for the 4th time" in _line(t, 4) and "; recovery 4 of at most 10: step 4 again" in _line(t, 4)
    assert [r["capture"] for r in t.recoveries()] == [
        str(rec / f / "rank0" / "nan_capture.pt") for f in ("step4", "step2", "step2_r2", "step4_r2")]


def test_under_rollback_a_nan_step_its_samples_explain_is_only_skipped(tmp_path):
    t, h = _healer(tmp_path, "rollback")
    _steps(t, h, range(2))
    _step(t, h, 2, [8, 9, 10, 11], nan=(9,))
    assert ("Recovered step 2: nonfinite_loss; update skipped (not rolled back: the weights are undamaged and the "
            "culprit samples are known); culprit sample(s) 9: ") in _line(t, 2)
    # The next rollback is the first one to its snapshot: the skipped step above did not return there.
    _steps(t, h, range(3, 5))
    _spike(h, 4, [16, 17, 18, 19])
    assert "; rolled back to step 0, 5 step(s) of data skipped; samples [16, 17, 18, 19]; capture:" in _line(t, 4)


# ---------------------------------------------------------------------- the diagnosis after training


def _diagnosed(tmp_path: Path, monkeypatch, rows: list[tuple[int, str]], *, world_size: int = 1, task: str = "custom",
               fail: tuple[int, ...] = ()) -> tuple[_Trainer, Healer, list[tuple[Path, Any]]]:
    """A healer whose recoveries are ``rows`` (step, trigger), each with a capture folder; diagnose
    recorded (folder, model) and answering ``verdict of <folder name>``, raising for steps in ``fail``."""
    calls: list[tuple[Path, Any]] = []

    def diagnose(folder, model=None):
        calls.append((Path(folder), model))
        name = next(p for p in reversed(Path(folder).parts) if p.startswith("step"))
        if int(name[4:]) in fail:
            raise ValueError("the capture cannot be read")
        return types.SimpleNamespace(verdict=f"verdict of {name}")

    monkeypatch.setattr(diagnose_mod, "diagnose", diagnose)
    t = _Trainer(tmp_path, task=task, world_size=world_size)
    h = Healer(t)
    for k, (step, trigger) in enumerate(rows, start=1):
        cap = t.out / "debug" / "recoveries" / f"step{step}" / "rank0" / "nan_capture.pt"
        h.recoveries.append({"step": step, "trigger": trigger, "recovery": k, "capture": str(cap)})
    return t, h, calls


def test_the_first_five_captures_are_diagnosed_and_at_the_limit_the_newest_too(tmp_path, monkeypatch):
    rows = [(s, "nonfinite_loss") for s in (10, 11, 12, 13, 14, 15, 16)]
    t, h, _ = _diagnosed(tmp_path, monkeypatch, rows)
    assert h._diagnose_captures() == {k: f"verdict of step{s}" for k, s in zip(range(1, 6), range(10, 15))}
    assert t.lines == [f"Diagnosis of the recovery at step {s}: verdict of step{s}" for s in range(10, 15)]
    t.lines.clear()
    assert h._diagnose_captures(last=True) == {**{k: f"verdict of step{s}" for k, s in zip(range(1, 6), range(10, 15))},
                                               7: "verdict of step16"}
    assert t.lines == [f"Diagnosis of the recovery at step {s}: verdict of step{s}" for s in (10, 11, 12, 13, 14, 16)]
    # Six captures: the sixth is the newest; one or two: none twice; limit 0: the newest alone.
    every = list(h.recoveries)
    for n, limit, expect in ((6, 5, [1, 2, 3, 4, 5, 6]), (1, 5, [1]), (2, 5, [1, 2]), (3, 0, [3]), (1, 0, [1])):
        h.recoveries = every[:n]
        t.lines.clear()
        assert list(h._diagnose_captures(limit=limit, last=True)) == expect, (n, limit)
        assert t.lines == [f"Diagnosis of the recovery at step {9 + k}: verdict of step{9 + k}" for k in expect]


def test_a_recovery_without_capture_is_not_diagnosed(tmp_path, monkeypatch):
    t, h, calls = _diagnosed(tmp_path, monkeypatch, [(3, "nonfinite_loss"), (4, "nonfinite_loss")])
    h.recoveries[0]["capture"] = None
    assert h._diagnose_captures(last=True) == {2: "verdict of step4"}
    assert [c[0] for c in calls] == [t.out / "debug" / "recoveries" / "step4" / "rank0"]


def test_a_diagnosis_that_fails_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    t, h, calls = _diagnosed(tmp_path, monkeypatch, [(3, "nonfinite_loss"), (4, "nonfinite_loss")], fail=(3,))
    assert h._diagnose_captures() == {2: "verdict of step4"}
    assert t.lines == ["Could not diagnose the capture of step 3: ValueError: the capture cannot be read",
                       "Diagnosis of the recovery at step 4: verdict of step4"]


def test_two_spikes_share_one_plural_diagnosis_line(tmp_path, monkeypatch):
    t, h, _ = _diagnosed(tmp_path, monkeypatch, [(8, "loss_spike"), (9, "loss_spike")])
    h._diagnose_captures()
    folder = t.out / "debug" / "recoveries" / "step8" / "rank0"
    assert t.lines == [f"Diagnosis of the recoveries at steps 8, 9 (loss_spike): their values were finite and the "
                       "diagnosis looks for NaN/Inf, so it has no verdict on a spike; the replay shows step 8's loss: "
                       f"stabletrain replay {folder}"]


def test_under_ddp_the_folder_of_ranks_is_diagnosed(tmp_path, monkeypatch):
    t, h, calls = _diagnosed(tmp_path, monkeypatch, [(3, "nonfinite_loss"), (5, "grad_spike")], world_size=2)
    h._diagnose_captures()
    rec = t.out / "debug" / "recoveries"
    assert [c[0] for c in calls] == [rec / "step3", rec / "step5"]
    assert t.lines[-1].endswith(f"the replay shows the step's loss: stabletrain replay {rec / 'step5'}")


def test_your_own_model_is_diagnosed_with_a_copy_and_a_built_in_one_from_its_settings(tmp_path, monkeypatch):
    t, h, calls = _diagnosed(tmp_path, monkeypatch, [(3, "nonfinite_loss")])
    h._diagnose_captures()
    model = calls[0][1]
    assert isinstance(model, Net) and model is not t.model
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), t.model.state_dict().values()))
    t, h, calls = _diagnosed(tmp_path / "lm", monkeypatch, [(3, "nonfinite_loss")], task="lm")
    h._diagnose_captures()
    assert calls[0][1] is None


# ---------------------------------------------------------------------- the helpers of the line


def test_ordinals_read_as_english():
    got = [_ordinal(n) for n in (1, 2, 3, 4, 10, 11, 12, 13, 20, 21, 22, 23, 101, 111, 112, 121)]
    assert got == ["1st", "2nd", "3rd", "4th", "10th", "11th", "12th", "13th", "20th", "21st", "22nd", "23rd",
                   "101st", "111th", "112th", "121st"]


def test_the_sample_list_puts_bad_data_then_culprits_first_and_counts_the_rest():
    assert _few([5, 6, 7]) == "[5, 6, 7]"
    assert _few(list(range(16))) == f"[{', '.join(map(str, range(16)))}]"
    assert _few(list(range(17))) == f"[{', '.join(map(str, range(16)))}, ... (1 more)]"
    # A culprit (isolated by replay) after the samples whose data holds NaN/Inf; one not in the list is left out.
    assert _few(list(range(20)), first=[3], then=[19, 3, 99]) == (
        "[3 (NaN/Inf in its data), 19, 0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, ... (4 more)]")


def test_row_values_keep_finite_floats_and_spell_out_the_others():
    assert row_value(1.5) == 1.5 and isinstance(row_value(1.5), float)
    assert (row_value(math.nan), row_value(math.inf), row_value(-math.inf)) == ("nan", "inf", "-inf")


def test_sample_indices_are_flattened_whatever_their_shape():
    assert _flat([torch.tensor([[1, 2], [3, 4]]), [5, 6], torch.tensor(7)]) == [1, 2, 3, 4, 5, 6, 7]


def test_the_recovery_limit_error_keeps_its_message_and_attributes_through_pickle(tmp_path):
    err = RecoveryLimitError("Step 9: loss_spike, after 2 recoveries", 9, 2, tmp_path / "nan_capture.pt")
    assert str(err) == "Step 9: loss_spike, after 2 recoveries"
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is RecoveryLimitError and str(back) == str(err)
    assert (back.step, back.recoveries, back.capture_path) == (9, 2, tmp_path / "nan_capture.pt")
