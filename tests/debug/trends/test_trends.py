"""Trend alerts: the detector on synthetic series, then live in the trainer on the built-in task."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from conftest import LinearData, tiny_lm
from stabletrain.config import TrendAlertArgs
from stabletrain.debug.trends import AlertContext, Episode, TrendAlerts, TrendDetector, detect_trends, next_actions
from stabletrain.loggers.jsonl import read_metrics
from stabletrain.safety.guard import NonFiniteStepError
from stabletrain.safety.net import NonFiniteCheckpointError
from stabletrain.training.loop import train
from stabletrain.utils.sync import SyncsPerStep


def noise(seed: int, n: int, decades: float = 0.1) -> np.ndarray:
    """Multiplicative noise: 10**N(0, decades), the scatter of a healthy gradient norm."""
    return 10 ** np.random.default_rng(seed).normal(0.0, decades, n)


def kinds(episodes: list[Episode]) -> list[tuple[str, str]]:
    return [(e.kind, e.signal) for e in episodes]


def feed(detector: TrendDetector, gradient_norm=None, loss=None, extra=None) -> list[list[Episode]]:
    """Feed a series point by point; return what each update() alerted."""
    n = max(len(gradient_norm if gradient_norm is not None else ()), len(loss if loss is not None else ()))
    alerts = []
    for i in range(n):
        point = dict(extra or {})
        if gradient_norm is not None:
            point["gradient_norm"] = float(gradient_norm[i])
        if loss is not None:
            point["loss"] = float(loss[i])
        alerts.append(detector.update(i, point))
    return alerts


# ------------------------------------------------------------------------ synthetic series


@pytest.mark.parametrize("seed", range(5))
def test_stable_noise_raises_nothing(seed):
    steps = np.arange(600)
    grad = 1.5 * noise(seed, 600)
    loss = (3.0 * np.exp(-steps / 150) + 0.8) * noise(seed + 100, 600, 0.02)  # learning, noisy batches
    assert detect_trends(gradient_norm=grad, loss=loss, warmup_steps=50) == []


def test_exponential_growth_is_exploding_once_soon_after_it_passes_the_factor():
    base = 2.0 * noise(0, 100)
    growth = 2.0 * 1.25 ** np.arange(1, 41)  # +25% per logged step from step 100
    grad = np.concatenate([base, growth])
    detector = TrendDetector(warmup_steps=10)
    alerts = [a for step_alerts in feed(detector, gradient_norm=grad) for a in step_alerts]
    assert kinds(alerts) == [("exploding", "gradient_norm")], "warned once, for one episode"
    e = alerts[0]
    tenfold = 100 + int(np.argmax(growth >= 10 * 2.0))  # first step 10x above the stable level
    assert tenfold <= e.detected_step <= tenfold + 5, (e.detected_step, tenfold)
    assert 100 <= e.start_step <= tenfold
    assert e.end_step == 139 and e.factor >= 10
    assert "exploding" in e.describe() and f"steps {e.start_step}-" in e.describe()


def test_decay_to_near_zero_is_vanishing_and_stays_one_episode():
    steps = np.arange(400)
    grad = np.exp(-steps / 30) * noise(1, 400, 0.05)  # 1 -> 1e-6
    loss = 2.3 * noise(2, 400, 0.01)  # the loss does not improve meanwhile
    episodes = detect_trends(gradient_norm=grad, loss=loss)
    vanishing = [e for e in episodes if e.kind == "vanishing"]
    assert len(vanishing) == 1
    e = vanishing[0]
    hundredfold = int(np.argmax(grad <= 0.01))
    assert hundredfold <= e.detected_step <= hundredfold + 10, (e.detected_step, hundredfold)
    assert e.end_step == 399, "it stays there"
    assert not any(k == "exploding" for k, _ in kinds(episodes))


def test_small_gradients_of_a_converged_model_are_not_vanishing():
    steps = np.arange(400)
    grad = np.exp(-steps / 30) * noise(1, 400, 0.05)
    loss = 2.3 * np.exp(-steps / 30) + 1e-4  # the loss fell 10x and more: the model fits its data
    assert [e for e in detect_trends(gradient_norm=grad, loss=loss) if e.kind == "vanishing"] == []


def test_single_warmup_spike_is_tolerated_not_exploding():
    grad = 1.0 * noise(3, 300)
    grad[30] = 60.0  # 60x, during warmup (steps < 100)
    detector = TrendDetector(warmup_steps=100)
    alerts = feed(detector, gradient_norm=grad)
    assert all(a == [] for a in alerts), "nothing alerted"
    assert kinds(detector.episodes) == [("spike", "gradient_norm")]
    spike = detector.episodes[0]
    assert spike.tolerated and (spike.start_step, spike.end_step) == (30, 30)
    assert "warmup" in spike.describe()


def test_spike_later_in_training_is_alerted_as_a_spike():
    grad = 1.0 * noise(4, 300)
    grad[200] = 60.0
    detector = TrendDetector(warmup_steps=100)
    alerts = feed(detector, gradient_norm=grad)
    assert kinds(alerts[200]) == [("spike", "gradient_norm")]
    assert sum(len(a) for a in alerts) == 1
    spike = alerts[200][0]
    assert (spike.start_step, spike.end_step, spike.tolerated, spike.open) == (200, 200, False, False)
    assert spike.factor == pytest.approx(60.0 / spike.reference * 1.0) and spike.factor > 30


def test_two_rising_points_by_orders_of_magnitude_are_exploding_not_a_tolerated_spike():
    """The last logged values before a NaN often are just this: no time for three."""
    grad = list(1.0 * noise(5, 40)) + [30.0, 1e6]
    detector = TrendDetector(warmup_steps=1000)  # all of it in warmup
    alerts = feed(detector, gradient_norm=grad)
    assert kinds(alerts[41]) == [("exploding", "gradient_norm")]


def test_loss_plateau_is_alerted_once():
    loss = 2.30 * noise(6, 300, 0.02)  # stuck near ln(10) from the start
    grad = 1.0 * noise(7, 300)
    detector = TrendDetector()
    alerts = [a for step_alerts in feed(detector, gradient_norm=grad, loss=loss) for a in step_alerts]
    assert kinds(alerts) == [("plateau", "loss")]
    e = alerts[0]
    assert e.detected_step == TrendAlertArgs().window - 1 and e.start_step == 0 and e.end_step == 299


def test_plateau_ends_when_the_loss_starts_to_fall_and_learning_loss_is_no_plateau():
    stuck = 2.30 * noise(8, 100, 0.01)
    learning = 2.30 * np.exp(-np.arange(200) / 40) * noise(9, 200, 0.01)
    episodes = detect_trends(loss=np.concatenate([stuck, learning]), gradient_norm=noise(10, 300))
    assert kinds(episodes) == [("plateau", "loss")]
    assert 100 <= episodes[0].end_step <= 130
    assert detect_trends(loss=learning, gradient_norm=noise(11, 200)) == []


def test_nonfinite_loss_warns_once_per_episode():
    loss = list(2.0 * np.exp(-np.arange(40) / 20) * noise(12, 40, 0.01))  # learning
    loss[20:23] = [math.nan] * 3
    loss[30] = math.inf
    detector = TrendDetector()
    alerts = feed(detector, loss=loss)
    alerted_at = [i for i, a in enumerate(alerts) if a]
    assert alerted_at == [20, 30]
    first = alerts[20][0]
    assert (first.kind, first.start_step, first.end_step) == ("nonfinite", 20, 22)


def test_nan_loss_and_gradient_norm_together_are_one_alert():
    grad, loss = [1.0] * 10 + [math.nan] * 3, [2.0] * 10 + [math.nan] * 3
    alerts = feed(TrendDetector(), gradient_norm=grad, loss=loss)
    assert kinds(alerts[10]) == [("nonfinite", "loss")]
    assert "and so is gradient_norm" in alerts[10][0].describe()


def test_under_fp16_loss_scaling_a_skipped_step_is_expected():
    grad = [1.0] * 30
    grad[10] = math.inf  # the GradScaler skips this step
    alerts = feed(TrendDetector(), gradient_norm=grad, extra={"loss_scale": 65536.0})
    assert all(a == [] for a in alerts)
    grad[20:24] = [math.inf] * 4  # but not step after step
    alerts = feed(TrendDetector(), gradient_norm=grad, extra={"loss_scale": 65536.0})
    assert [i for i, a in enumerate(alerts) if a] == [22]
    assert kinds(alerts[22]) == [("nonfinite", "gradient_norm")] and alerts[22][0].start_step == 20


def _fp16_rows(skips: set[int], scales=None, n: int = 30, count=True):
    """Logged rows of an fp16 run: a NaN gradient norm with a finite loss where the GradScaler skipped
    (the guard's cumulative ``skipped_steps`` grows there), the scale halving at each skip."""
    rows, skipped, scale = [], 0, 2.0**24 if scales is None else scales
    for i in range(n):
        if i in skips:
            skipped, scale = skipped + 1, scale / 2
        row = {"loss": 5.0 * 0.95**i, "gradient_norm": math.nan if i in skips else 1.0, "loss_scale": scale}
        if count:
            row["skipped_steps"] = float(skipped)
        rows.append(row)
    return rows


def test_under_fp16_the_scalers_own_skips_are_expected_however_many_in_a_row():
    """A scale too high at the start: 8 skips in a row, each with the guard's count growing. They are
    the scaler's rule, not a non-finite gradient norm (before: an alert after 3, and a report verdict
    "non-finite" for a healthy run)."""
    detector = TrendDetector()
    alerts = [detector.update(i, row) for i, row in enumerate(_fp16_rows(set(range(8))))]
    assert all(a == [] for a in alerts) and detector.finish() == []
    assert detector.scaler_skips == list(range(8))
    # Without the guard's count (the guard off) the old rule: expected only when not step after step.
    detector = TrendDetector()
    alerts = [detector.update(i, row) for i, row in enumerate(_fp16_rows(set(range(8)), count=False))]
    assert [i for i, a in enumerate(alerts) if a] == [2] and detector.scaler_skips == []
    # A NaN norm where the count did not grow is not the scaler's skip.
    rows = _fp16_rows(set(range(8)))
    for r in rows[10:14]:
        r["gradient_norm"] = math.nan
    detector = TrendDetector()
    alerts = [detector.update(i, row) for i, row in enumerate(rows)]
    assert [i for i, a in enumerate(alerts) if a] == [12] and alerts[12][0].start_step == 10
    # Skips that drove the scale below 1 are the fault's: the alert comes back.
    detector = TrendDetector()
    alerts = [detector.update(i, row) for i, row in enumerate(_fp16_rows(set(range(8)), scales=8.0))]
    assert [i for i, a in enumerate(alerts) if a] == [5] and alerts[5][0].kind == "nonfinite"


def test_next_actions_are_concrete():
    ctx = AlertContext(lr=3e-3, precision="16-mixed", gradient_clip_val=0.0, warmup_steps=50, n_params=470_528, task="image_classification")
    boom = Episode("exploding", "gradient_norm", 10, 20, 20, 500.0, 2.0)
    actions = next_actions(boom, ctx)
    assert "model_args.lr=0.0003 (now 0.003)" in actions[0]
    assert any("precision=bf16-mixed" in a and "now 16-mixed" in a for a in actions)
    assert any("gradient_clip_val=1.0" in a for a in actions)
    fading = Episode("vanishing", "gradient_norm", 10, 20, 20, 1e-5, 1.0)
    actions = next_actions(fading, ctx)
    assert "model_args.lr=0.009 (now 0.003)" in actions[0] and "470,528 parameters" in actions[0]
    assert any("transform_args.normalize" in a for a in actions)
    event = boom.to_event(ctx)
    assert event["event"] == "trend_alert" and (event["start_step"], event["end_step"]) == (10, 20)
    assert event["factor"] == 250.0 and event["actions"] == next_actions(boom, ctx)


def test_detector_state_continues_after_resume(tmp_path):
    """A resumed run re-reads the steps logged before its checkpoint: an explosion already
    alerted is not alerted again, while a detector starting afresh would alert it again."""
    grad = [1.0] * 30 + [1e3 * 3**i for i in range(12)]  # exploding from step 30, alerted at 31
    out = tmp_path / "run"
    out.mkdir()
    lines = [f'{{"step": {i}, "gradient_norm": {g}, "loss": 2.0}}' for i, g in enumerate(grad[:32])]
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    def trainer(resume: bool):
        settings = SimpleNamespace(
            trend_alerts=TrendAlertArgs(), model_args=SimpleNamespace(warmup_steps=0, lr=1e-3),
            gradient_clip_val=0.0, resume_interrupted=resume,
        )
        said = []
        return SimpleNamespace(
            settings=settings, out=out, step=32, precision="32-true", task=None,
            model=SimpleNamespace(parameters=lambda: []),
            console=SimpleNamespace(info=said.append), log_event=lambda e: None, said=said,
        )

    for resume, expected in ((True, []), (False, ["exploding"])):
        t = trainer(resume)
        cb = TrendAlerts()
        cb.on_train_start(t)
        for step in range(32, len(grad)):
            cb.on_log(t, step=step, metrics={"gradient_norm": grad[step], "loss": 2.0})
        assert [a["kind"] for a in cb.alerts] == expected, resume


# ------------------------------------------------------------------------------ in training


def test_exploding_run_of_the_builtin_task_is_flagged_before_nan(tmp_path, capsys):
    """SGD with lr=10 on the built-in language model: the gradient norm grows by orders of
    magnitude for a few steps, then the loss becomes NaN."""
    out = tmp_path / "boom"
    # The guard off: the run goes on through NaN (the final checkpoint is refused).
    with pytest.raises(NonFiniteCheckpointError):
        train(out=out, guard={"enabled": False}, **tiny_lm(steps=12, model_args={"optimizer": "sgd", "lr": 10.0}))
    rows, events = read_metrics(out / "metrics.jsonl")
    nonfinite = [r["step"] for r in rows if not (math.isfinite(r["loss"]) and math.isfinite(r["gradient_norm"]))]
    assert nonfinite, "the run does reach NaN (else 'before NaN' proves nothing)"
    alerts = [e for e in events if e["event"] == "trend_alert"]
    exploding = [e for e in alerts if e["kind"] == "exploding" and e["signal"] == "gradient_norm"]
    assert len(exploding) == 1
    assert exploding[0]["step"] < nonfinite[0], (exploding[0], nonfinite[0])
    assert exploding[0]["start_step"] <= exploding[0]["step"] and exploding[0]["factor"] >= 10
    assert any("model_args.lr=1 (now 10; the run's lr x0.1, not verified" in a for a in exploding[0]["actions"])
    assert [e["kind"] for e in alerts if e["signal"] == "loss" and e["kind"] == "nonfinite"] == ["nonfinite"]

    console = capsys.readouterr().out
    assert f"WARNING gradient_norm is exploding (steps {exploding[0]['start_step']}-" in console
    assert "next: lower the learning rate: model_args.lr=1 (now 10; the run's lr x0.1, not verified" in console
    assert console.count("WARNING gradient_norm is exploding") == 1, "once per episode"
    assert "WARNING gradient_norm is exploding" in (out / "train.log").read_text()


def test_stable_run_of_the_builtin_task_raises_no_alert(tmp_path, capsys):
    out = tmp_path / "stable"
    train(out=out, **tiny_lm(steps=150, model_args={"warmup_steps": 10}))
    rows, events = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 150 and rows[-1]["loss"] < rows[0]["loss"] - 1.0, "it learns"
    assert [e for e in events if e["event"] == "trend_alert"] == []
    assert "WARNING" not in capsys.readouterr().out


def test_trend_alerts_can_be_turned_off(tmp_path):
    out = tmp_path / "boom"
    train(out=out, trend_alerts={"enabled": False}, **tiny_lm(steps=8, model_args={"optimizer": "sgd", "lr": 10.0}))
    _, events = read_metrics(out / "metrics.jsonl")
    assert [e for e in events if e["event"] == "trend_alert"] == []




def test_trend_alerts_add_no_host_sync(tmp_path):
    counts = {}
    for enabled in (True, False):
        counter = SyncsPerStep()
        with pytest.raises(NonFiniteStepError) as info:  # the guard stops the exploding run at its first NaN
            train(
                out=tmp_path / str(enabled), callbacks=[counter], trend_alerts={"enabled": enabled},
                **tiny_lm(steps=12, checkpoint_every_num_steps=1, model_args={"optimizer": "sgd", "lr": 10.0}),
            )
        counts[enabled] = counter.counts
    assert sorted(counts[True]) == list(range(info.value.step + 1)) and info.value.step >= 6
    assert counts[True] == counts[False]


class _NanGradientAt(nn.Module):
    """A regression whose gradients (not its loss) turn NaN at one step: 0 * sqrt(w - w) is a
    finite 0, its gradient 0 * inf = NaN. SGD writes the NaN into the weights, so the loss
    is NaN from the next step on: gradient_norm goes first, the loss one step later."""

    def __init__(self, bad_step: int):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 1)
        self.bad_step, self.calls = bad_step, 0

    def training_step(self, batch):
        loss = nn.functional.mse_loss(self.body(batch["x"]), batch["y"])
        if self.calls == self.bad_step:
            w = self.body.weight
            loss = loss + 0.0 * torch.sqrt(w - w).sum()
        self.calls += 1
        return loss




def test_nan_gradients_then_nan_loss_the_loss_gets_a_follow_up_alert(tmp_path, capsys):
    """Training, with the fault planted at step 6: the gradient_norm alert at step 6 gives the
    next actions; at step 7 one more line (and one metrics.jsonl row) says the loss is gone
    too, from step 7, without repeating the actions."""
    out = tmp_path / "run"
    with pytest.raises(NonFiniteCheckpointError):  # the guard off: NaN reaches the end, its checkpoint is refused
        train(out=out, model=_NanGradientAt(6), data=LinearData(), steps=10, batch_size=16, log_every_num_steps=1,
              guard={"enabled": False}, model_args={"optimizer": "sgd", "lr": 0.01, "warmup_steps": 0})
    rows, events = read_metrics(out / "metrics.jsonl")
    by_step = {r["step"]: r for r in rows}
    assert math.isfinite(by_step[6]["loss"]) and math.isnan(by_step[6]["gradient_norm"]), "the planted fault"
    assert math.isnan(by_step[7]["loss"])
    alerts = [e for e in events if e["event"] == "trend_alert"]
    assert [(e["signal"], e["kind"], e["step"], e["start_step"]) for e in alerts] == [
        ("gradient_norm", "nonfinite", 6, 6), ("loss", "nonfinite", 7, 7)
    ]
    follow_up = alerts[1]
    assert follow_up["follows"] == "gradient_norm" and "follows" not in alerts[0]
    assert follow_up["message"] == "loss is not finite (step 7): nan, after gradient_norm, not finite since step 6"

    console = capsys.readouterr().out
    assert "WARNING gradient_norm is not finite (step 6): nan.\n  next: no healthy checkpoint yet" in console
    follow_line = "WARNING loss is not finite (step 7): nan, after gradient_norm, not finite since step 6.\n"
    assert follow_line in console
    after = console[console.index(follow_line) + len(follow_line):]
    assert "next:" not in after.split("WARNING")[0], "the follow-up repeats no actions"
    assert console.count("WARNING") == 2 and console.count("next: no healthy checkpoint yet") == 1
    assert follow_line.strip() in (out / "train.log").read_text()


def test_each_nonfinite_signal_keeps_its_own_range():
    grad = [1.0] * 10 + [math.nan] * 4
    loss = [2.0 - 0.01 * i for i in range(11)] + [math.nan] * 3  # the loss follows one step later
    detector = TrendDetector()
    alerts = feed(detector, gradient_norm=grad, loss=loss)
    assert [i for i, a in enumerate(alerts) if a] == [10, 11]
    assert [(e.signal, e.follows) for e in alerts[10] + alerts[11]] == [("gradient_norm", ""), ("loss", "gradient_norm")]
    detector.finish()
    assert [(e.signal, e.start_step, e.end_step) for e in detector.episodes] == [("gradient_norm", 10, 13), ("loss", 11, 13)]
    # The other way round (fp16: gradient_norm needs 3 points in a row): the NaN gradients a
    # NaN loss makes are recorded with their own range, not alerted.
    detector = TrendDetector()
    alerts = feed(detector, gradient_norm=grad[:10] + [math.inf] * 4, loss=[2.0] * 10 + [math.nan] * 4,
                  extra={"loss_scale": 1024.0})
    assert [(i, e.signal) for i, a in enumerate(alerts) for e in a] == [(10, "loss")]
    gn = next(e for e in detector.episodes if e.signal == "gradient_norm")
    assert (gn.kind, gn.start_step, gn.merged) == ("nonfinite", 10, True)
