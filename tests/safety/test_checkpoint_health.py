"""Checkpoint health: measured when written, recorded in the file, named the same by every
message, diagnose and report; rotation keeps the newest healthy one; resume_from."""

from __future__ import annotations

import json
import math

import pytest
import torch

import stabletrain
from conftest import LinearData, tiny_lm
from stabletrain import NaNDetectedError
from stabletrain.errors import ConfigError
from stabletrain.loggers.jsonl import read_metrics
from stabletrain.runfiles.checkpoint import list_checkpoints, load_checkpoint, newest_healthy
from stabletrain.safety.net import NonFiniteCheckpointError
from stabletrain.training.loop import train

# SGD at lr 3 after a 10-step warmup: runaway updates from step 3 (the loss rises while each step changes
# the weights by more than their size; named at step 4), so healthy up to step 2; exploding from step 5, NaN at
# step 17.
DIVERGING = tiny_lm(steps=40, checkpoint_every_num_steps=2, max_checkpoints_to_keep=1,
                    model_args={"optimizer": "sgd", "lr": 3.0, "warmup_steps": 10})


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    out = tmp_path_factory.mktemp("health") / "diverged"
    with pytest.raises(NaNDetectedError) as info:
        train(out=out, debug_args={"nancapture": {"enabled": True}}, **DIVERGING)
    return out, info.value


def test_a_diverging_run_names_one_healthy_checkpoint_everywhere_and_rotation_kept_it(diverged):
    out, err = diverged
    folder = out / "checkpoints"
    best = newest_healthy(folder)
    assert best is not None and best.step == 2 and best.path == folder / "step_000002.ckpt"
    # Rotation (max_checkpoints_to_keep=1) kept it, besides the newest periodic file and last.ckpt: step_000004 was
    # written healthy with the runaway rule pending since step 3 (health["pending_since"]), so step_000002 stayed.
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["last.ckpt", "step_000002.ckpt", f"step_{err.step // 2 * 2:06d}.ckpt"]
    infos = list_checkpoints(folder)
    assert [(c.step, c.healthy) for c in infos] == [(2, True), (err.step // 2 * 2, False)]
    _, events = read_metrics(out / "metrics.jsonl")
    (runaway,) = [e for e in events if e["event"] == "mechanism"][:1]
    assert (runaway["id"], runaway["start_step"], runaway["step"]) == ("runaway_updates", 3, 4)
    health = load_checkpoint(folder / "step_000002.ckpt")["health"]
    assert health["healthy"] and health["finite"] and "no exploding or non-finite episode open" in health["why"]
    unhealthy = infos[-1].health
    assert any("exploding" in p for p in unhealthy["problems"]), unhealthy["problems"]

    # nancapture's error, diagnose and report name the same checkpoint, and say why.
    assert f"The newest healthy checkpoint is {best.path}, from before step 2: {best.why}." in str(err)
    assert f"resume_from={best.path}" in str(err)
    d = stabletrain.diagnose(err.capture_path, write=False)
    assert d.weights.healthy_checkpoint == str(best.path)
    assert f"resume_from={best.path}" in d.next_actions[0] and best.why in d.next_actions[0]
    _, events = read_metrics(out / "metrics.jsonl")
    alerts = [e for e in events if e["event"] == "trend_alert" and e["kind"] == "exploding"]
    assert alerts and all(f"go back to the newest healthy checkpoint (step 2: {best.why}): resume_from={best.path}"
                          in e["actions"] for e in alerts), "the live alerts name it too"
    r = stabletrain.report(out, quiet=True)
    assert f"newest healthy checkpoint: {best.path} (step 2: {best.why})" in r.text
    assert f"resume_from={best.path}" in r.text
    assert r.verdict == "non-finite"


def test_resume_from_the_healthy_checkpoint_continues_and_the_loss_recovers(diverged, tmp_path):
    out, err = diverged
    best = newest_healthy(out / "checkpoints")
    settings = {**DIVERGING, "model_args": {**DIVERGING["model_args"], "lr": 0.3}}
    result = train(out=out, resume_from=best.path, **settings)
    assert result.steps_done == 40
    history = stabletrain.report(out, quiet=True)
    rows, events = read_metrics(out / "metrics.jsonl")
    assert [(e["event"], e["step"]) for e in events if e["event"] == "resume"] == [("resume", 2)]
    resumed = rows[-38:]
    assert [r["step"] for r in resumed] == list(range(2, 40))
    assert all(math.isfinite(r["loss"]) for r in resumed)
    assert resumed[0]["loss"] == next(r["loss"] for r in rows if r["step"] == 2), "bitwise the state of step 2"
    assert resumed[-1]["loss"] < resumed[0]["loss"], "the loss recovers"
    # The report reads one timeline: the resumed rows and events replace the diverged ones, and the
    # blow-up before the resume stays in the verdict, answered by the resume (issue 25, item 8).
    assert history.verdict == "non-finite", history.text
    bad = [e for e in history.episodes if e.kind in ("nonfinite", "exploding")]
    assert bad and all(e.settled for e in bad), [e.describe() for e in bad]
    assert "(steps 0-39, 40 logged points (every step))" in history.text
    assert "Resumed from step 2" in (out / "train.log").read_text()


def test_rotation_keeps_the_newest_healthy_checkpoint_even_with_keep_0(tmp_path):
    out = tmp_path / "keep0"
    with pytest.raises(stabletrain.StabletrainError):
        train(out=out, **{**DIVERGING, "max_checkpoints_to_keep": 0})
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["last.ckpt", "step_000002.ckpt"], "last.ckpt's healthy state got its name before being replaced"
    assert newest_healthy(out / "checkpoints").path.name == "step_000002.ckpt"
    assert load_checkpoint(out / "checkpoints" / "step_000002.ckpt")["health"]["healthy"]


def test_a_checkpoint_with_a_nonfinite_buffer_is_refused_and_the_previous_one_stays(tmp_path):
    from torch import nn

    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.fc = nn.Linear(4, 1)
            self.register_buffer("seen", torch.zeros(1))

        def training_step(self, batch):
            return nn.functional.mse_loss(self.fc(batch["x"]), batch["y"])

    class Damage:
        def on_after_optimizer_step(self, trainer, *, step):
            if step == 2:
                trainer.model.seen.fill_(math.inf)

    out = tmp_path / "run"
    with pytest.raises(NonFiniteCheckpointError) as info:
        train(out=out, model=WithBuffer(), data=LinearData(), callbacks=[Damage()], steps=6, batch_size=16,
              checkpoint_every_num_steps=2, model_args={"warmup_steps": 0})
    assert info.value.step == 4 and info.value.entries == ["model seen"]
    assert "Refused to write the checkpoint after step 3: the state holds NaN/Inf in model seen" in str(info.value)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last.ckpt", "step_000002.ckpt"]
    assert load_checkpoint(out / "checkpoints" / "last.ckpt")["step"] == 2
    assert "ERROR NonFiniteCheckpointError" in (out / "train.log").read_text()


def test_resume_refuses_a_checkpoint_holding_nan_and_names_the_healthy_one(tmp_path):
    out = tmp_path / "run"
    train(out=out, **tiny_lm(steps=4, checkpoint_every_num_steps=2))
    # A checkpoint damaged outside stabletrain (or written by an older version).
    last = out / "checkpoints" / "last.ckpt"
    state = torch.load(last, weights_only=True)
    state["model"]["head.weight"][0, 0] = math.nan
    torch.save(state, last)
    with pytest.raises(ConfigError) as info:
        train(out=out, resume_interrupted=True, **tiny_lm(steps=6, checkpoint_every_num_steps=2))
    text = str(info.value)
    assert f"resume_interrupted: {last} holds NaN/Inf (model head.weight)" in text
    assert f"continue from resume_from={out / 'checkpoints' / 'step_000002.ckpt'} (step 2, healthy)" in text
    result = train(out=out, resume_from=out / "checkpoints" / "step_000002.ckpt", **tiny_lm(steps=6))
    assert result.steps_done == 6


def test_resume_from_mistakes_are_config_errors(tmp_path):
    out = tmp_path / "run"
    train(out=out, **tiny_lm(steps=2))
    with pytest.raises(ConfigError, match="resume_from: no checkpoint file at"):
        train(out=out, resume_from=out / "checkpoints" / "step_000099.ckpt", **tiny_lm(steps=4))
    with pytest.raises(ConfigError, match="resume_from: given together with resume_interrupted=true; use one"):
        train(out=out, resume_from=out / "checkpoints" / "last.ckpt", resume_interrupted=True, **tiny_lm(steps=4))
    with pytest.raises(ConfigError, match="the checkpoint already holds 2 steps"):
        train(out=out, resume_from=out / "checkpoints" / "last.ckpt", **tiny_lm(steps=2))


def test_resume_without_a_checkpoint_advises_overwrite(tmp_path):
    """No circular advice: a run stopped before its first checkpoint is started again."""
    out = tmp_path / "run"
    (out).mkdir()
    (out / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError) as info:
        train(out=out, resume_interrupted=True, **tiny_lm(steps=2))
    assert "the run stopped before its first checkpoint; start again with overwrite=true" in str(info.value)
    assert train(out=out, overwrite=True, **tiny_lm(steps=2)).steps_done == 2


def test_a_checkpoint_inside_a_spike_the_self_healing_recovered_from_is_not_healthy(tmp_path):
    """Issue 25, item 9: after a recovery the episode stays open until the loss is back for
    ``persist`` logged steps; the checkpoints written before that are not healthy, those after are."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from heal_faults import SPIKE_STEP, settings

    from stabletrain.runfiles.checkpoint import read_checkpoint_health

    out = tmp_path / "run"
    s = settings(out, "skip_step")
    s.update(checkpoint_every_num_steps=1, max_checkpoints_to_keep=100)
    train(**s)
    health = {}
    for path in sorted((out / "checkpoints").glob("step_*.ckpt")):
        step, info = read_checkpoint_health(path)[:2]
        health[step] = info
    spike_row = next(r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                     if r.get("event") == "recovery" and r.get("trigger") == "loss_spike")
    assert spike_row["step"] == SPIKE_STEP
    # The checkpoint holding step SPIKE_STEP's (skipped) step, and the next ones until the loss has been
    # calm for 3 logged steps (persist), are not healthy; the one before the spike is.
    assert health[SPIKE_STEP]["healthy"], health[SPIKE_STEP]["why"]
    opened = health[SPIKE_STEP + 1]
    assert not opened["healthy"] and "loss_spike episode the self-healing recovered from at step 32 is still open" \
        in opened["why"], opened["why"]
    assert health[SPIKE_STEP + 4]["healthy"], health[SPIKE_STEP + 4]["why"]


def test_a_spike_episode_open_at_an_interruption_stays_open_after_the_resume(tmp_path):
    """Issue 25: the open episode was not carried across a resume, so the first checkpoint after
    resuming inside it was called healthy. Stopped inside the episode and resumed, every checkpoint
    is judged as in the uninterrupted run."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from heal_faults import NAN_STEP, SPIKE_STEP, settings

    from stabletrain.runfiles.checkpoint import read_checkpoint_health

    class StopAt:
        def on_step_start(self, trainer, *, step):
            if step == SPIKE_STEP + 1:
                trainer.request_stop("stopped by the test inside the spike episode")

    def healths(out):
        return {step: info for step, info in (read_checkpoint_health(p)[:2]
                                              for p in sorted((out / "checkpoints").glob("step_*.ckpt")))}

    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    for out, callbacks in ((straight, []), (stopped, [StopAt()])):
        torch.manual_seed(0)  # the model draws its weights before train() seeds
        s = settings(out, "skip_step", callbacks=callbacks)
        s.update(checkpoint_every_num_steps=1, max_checkpoints_to_keep=100)
        train(**s)
    last = torch.load(stopped / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["step"] == SPIKE_STEP + 2 and not last["health"]["healthy"]
    assert last["health"]["open_spike"]["first"] == SPIKE_STEP
    torch.manual_seed(0)
    s = settings(stopped, "skip_step", resume_interrupted=True)
    s.update(checkpoint_every_num_steps=1, max_checkpoints_to_keep=100)
    train(**s)
    expected, resumed = healths(straight), healths(stopped)
    assert sorted(resumed) == sorted(set(expected) - {SPIKE_STEP + 2})  # the stop wrote last.ckpt only
    # Each recovery's episode stays open until the loss has been back for 3 logged steps (persist).
    assert [s for s in expected if not expected[s]["healthy"]] == [*range(NAN_STEP + 1, NAN_STEP + 4),
                                                                   *range(SPIKE_STEP + 1, SPIKE_STEP + 4)]
    for step in resumed:  # the resume is bitwise: the same verdicts, for the same reasons
        assert (resumed[step]["healthy"], resumed[step]["why"]) == (expected[step]["healthy"], expected[step]["why"])
    why = resumed[SPIKE_STEP + 3]["why"]
    assert "loss_spike episode the self-healing recovered from at step 32 is still open" in why
    # The level the loss must come back to is from before the spike, not the skipped spike's own loss.
    reference = last["health"]["open_spike"]["reference"]
    assert reference < 100 and f"at or below {reference:.4g}, the highest of the " in why


def test_a_checkpoint_named_unhealthy_later_is_not_called_healthy_on_resume_nor_after_it(tmp_path):
    """Attention-logit growth begins at step 10 and is named at step 20: the checkpoint written after step 19
    was recorded healthy (nothing named yet), and every message since calls it not healthy. A resume from it
    said "(healthy: ... no mechanism named in the signals)", and once the resume had replaced the timeline that
    named the growth, list_checkpoints called it healthy again, though steps 10-19 are in the timeline kept."""
    import mechanism_runs as runs

    rows = runs.run_attention_growth(tmp_path, steps=40, checkpoint_every_num_steps=10, max_checkpoints_to_keep=10)
    event = runs.mechanism_events(rows)[0]
    start, named = event["start_step"], event["step"]
    folder = rows.out / "checkpoints"
    inside = [c for c in list_checkpoints(folder) if start < c.step <= named]
    assert inside and inside[-1].health["healthy"], "recorded healthy when written: the growth was named later"
    resumed_from = inside[-1]
    assert not resumed_from.healthy and resumed_from.why.startswith(f"written after attention-logit growth began at "
                                                                    f"step {start} (named at step {named};")
    again = runs.run_lm(rows.out, steps=40, log_every_num_steps=10, checkpoint_every_num_steps=10,
                        max_checkpoints_to_keep=10, resume_from=str(resumed_from.path), model_args={"lr": 0.01})
    assert again.error is None, again.error
    assert (f"Resumed from step {resumed_from.step}: {resumed_from.path} (not healthy: written after attention-logit "
            f"growth began at step {start} (named at step {named}; metrics.jsonl))") in again.console
    # The resumed timeline named it again (its rows before the resume are the same): the checkpoint stays not healthy.
    after = {c.step: c for c in list_checkpoints(folder)}[resumed_from.step]
    assert not after.healthy and "attention-logit growth began at step" in after.why
    # A checkpoint from before it began is as healthy as it was.
    assert all(c.healthy for c in list_checkpoints(folder) if c.step <= start)


def test_a_mechanism_named_after_the_resume_step_still_covers_the_checkpoints_it_began_before(tmp_path):
    """A resume to step 25 abandons the timeline that named a mechanism at step 30; it began at step 10,
    so the checkpoints of steps 11-25 (in the timeline kept) stay not healthy, those after 25 are the new
    timeline's to judge, and a mechanism that began at or after step 25 is gone with its timeline."""
    from stabletrain.runfiles.history import mechanism_spans

    rows = [{"step": s, "loss": 1.0} for s in range(0, 40, 5)]
    events = [{"event": "mechanism", "step": 30, "id": "attention_logit_growth", "name": "attention-logit growth",
               "start_step": 10, "detected_step": 30},
              {"event": "mechanism", "step": 35, "id": "runaway_updates", "name": "runaway updates", "start_step": 25,
               "detected_step": 35},
              {"event": "resume", "step": 25, "checkpoint": "x"}]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for row in [*rows, *events, *({"step": s, "loss": 0.5} for s in range(25, 50, 5))]:
            f.write(json.dumps(row) + "\n")
    (span,) = mechanism_spans(tmp_path)
    assert (span.name, span.start_step, span.end_step, span.replaced_at) == ("attention-logit growth", 10, 24, 25)
    assert [s for s in range(0, 50, 5) if span.covers(s)] == [15, 20, 25]
    assert span.why() == ("written after attention-logit growth began at step 10 (named at step 30, in the timeline "
                          "that the resume from step 25 replaced; metrics.jsonl)")
