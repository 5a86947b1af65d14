"""Real, unplanted reproductions of the silent instabilities (tests/mechanism_runs.py): the
built-in trainer, settings only, and the signals the run logs show each mechanism and its fix.

The numbers asserted are those of the runs (docs/mechanisms.md#reproductions), with margins:
each reproduction is compared with the same run at a good setting, not with a fixed constant
alone."""

from __future__ import annotations

import math
from typing import Any, Callable

import mechanism_runs as runs
import pytest


@pytest.fixture(scope="module")
def run_once(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., list[dict[str, Any]]]:
    """Each distinct run once per module: several tests read the same rows."""
    cache: dict[tuple, list[dict[str, Any]]] = {}

    def get(fn: Callable[..., list[dict[str, Any]]], **kw: Any) -> list[dict[str, Any]]:
        key = (fn.__name__, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = fn(tmp_path_factory.mktemp(fn.__name__), **kw)
        return cache[key]

    return get


def values(rows: list[dict], key: str) -> list[float]:
    return [v for _, v in runs.series(rows, key)]


# --------------------------------------------------------------------------------------
# a. attention-logit growth at a high lr; qk_norm removes it
# --------------------------------------------------------------------------------------


def test_attention_logits_grow_by_orders_of_magnitude_at_a_high_lr(run_once):
    rows = run_once(runs.run_attention_growth)  # AdamW, lr 0.1, no weight decay, no dropout
    logit_max = values(rows, "signals/attn_logit_max")
    entropy = values(rows, "signals/attn_entropy_min")
    assert logit_max[0] < 1 and entropy[0] > 1.5  # nearly uniform attention at initialisation
    assert max(logit_max) > 1000 * logit_max[0] and max(logit_max) > 100
    assert min(entropy) < 0.05  # one-hot attention: about one key per query
    growth = runs.first_departure(rows, "signals/attn_logit_max", factor=100)
    assert growth is not None and growth <= 20  # early: within the first 10% of the run
    assert all(math.isfinite(v) for v in values(rows, "loss"))  # silent: no NaN, no Inf
    assert rows.error is None and "Done: 200 steps" in rows.console
    # No checkpoint was written before the growth began (every 100 steps): the messages say so,
    # not that some were and are not healthy.
    start = runs.mechanism_events(rows)[0]["start_step"]
    assert start < 100 and f"no checkpoint was written before step {start}: a fix starts over" in rows.console
    assert f"are not healthy: no checkpoint was written before step {start}. Details" in rows.console
    assert "is healthy" not in rows.console
    assert [e["attention_modules"] for e in rows.events if e["event"] == "mechanism_signals"] == [["blocks.0.attn"]]


def test_the_high_lr_run_ends_far_worse_than_a_good_lr(run_once):
    high = runs.final_loss(run_once(runs.run_attention_growth))
    good_rows = run_once(runs.run_attention_growth, lr=0.01)
    good = runs.final_loss(good_rows)
    assert high > good + 0.4, (high, good)
    assert max(values(good_rows, "signals/attn_logit_max")) < 100  # at a good lr the logits stay moderate


def test_qk_norm_bounds_the_attention_logits_and_lowers_the_loss(run_once):
    plain = run_once(runs.run_attention_growth)
    normed = run_once(runs.run_attention_growth, qk_norm=True)
    assert max(values(normed, "signals/attn_logit_max")) < 50
    assert min(values(normed, "signals/attn_entropy_min")) > 0.1
    assert runs.final_loss(normed) < runs.final_loss(plain) - 0.2, (runs.final_loss(normed), runs.final_loss(plain))


# --------------------------------------------------------------------------------------
# c. the Adam epsilon regime; a lower eps fixes it
# --------------------------------------------------------------------------------------


def test_an_eps_far_above_the_gradients_rms_stalls_adamw(run_once):
    stalled = run_once(runs.run_adam_eps)  # eps 1
    healthy = run_once(runs.run_adam_eps, eps=1e-8)
    assert min(values(stalled, "signals/adam_eps_fraction")) > 0.99
    # eps 1e-8: only the embedding rows of bytes the text never holds (no gradient, v = 0).
    assert max(values(healthy, "signals/adam_eps_fraction")) < 0.3
    # The updates collapse: the first is over 50x smaller, and the weights hardly move at all.
    update, healthy_update = values(stalled, "signals/update_rms/decay"), values(healthy, "signals/update_rms/decay")
    assert update[0] < healthy_update[0] / 50
    weights, healthy_weights = values(stalled, "signals/weight_rms/decay"), values(healthy, "signals/weight_rms/decay")
    assert weights[-1] < 1.05 * weights[0] and healthy_weights[-1] > 2 * healthy_weights[0]
    # Training stalls: the loss falls by less than 1 nat where eps 1e-8 falls by nearly 3.
    first = values(stalled, "loss")[0]
    assert runs.final_loss(stalled) > first - 1.0
    assert runs.final_loss(stalled) > runs.final_loss(healthy) + 1.5


# --------------------------------------------------------------------------------------
# d. SGD at too high an lr (the README tour)
# --------------------------------------------------------------------------------------


def test_sgd_at_lr_1_grows_the_weights_then_goes_nan(run_once):
    rows = run_once(runs.run_sgd_blowup)
    nan_step = runs.first_nonfinite(rows)
    assert nan_step is not None and rows[-1]["step"] == nan_step  # the guard stopped the run there
    assert type(rows.error).__name__ == "NonFiniteStepError" and f"step {nan_step}" in str(rows.error)
    weights = runs.series(rows, "signals/weight_rms/decay")
    finite = [(s, v) for s, v in weights if math.isfinite(v)]
    assert finite[-1][1] > 1000 * finite[0][1]  # the weights grew by orders of magnitude first
    grown = runs.first_departure(rows, "signals/weight_rms/decay", factor=2)
    doubled = runs.first_departure(rows, "loss", factor=2)
    assert grown is not None and doubled is not None
    assert grown < doubled < nan_step and nan_step - grown >= 10  # the signal leads the NaN by 10+ steps
    assert max(values(rows, "signals/update_rms_max")[:nan_step]) > 1  # updates larger than the weights


def test_sgd_at_a_tenth_of_the_lr_trains(run_once):
    rows = run_once(runs.run_sgd_blowup, lr=0.1)
    assert runs.first_nonfinite(rows) is None and rows[-1]["step"] == 99
    weights = values(rows, "signals/weight_rms/decay")
    assert weights[-1] < 5 * weights[0]  # the weights stay at their scale
    assert runs.final_loss(rows) < values(rows, "loss")[0] - 2.5


# --------------------------------------------------------------------------------------
# Each mechanism named: the live alert, the report, diagnose; before the loss is lost
# --------------------------------------------------------------------------------------

#: reproduction -> (the run, the same run at a good setting, the mechanism the rules must name)
NAMED = {
    "attention": (lambda get, **kw: get(runs.run_attention_growth, **kw),
                  lambda get, **kw: get(runs.run_attention_growth, lr=0.01, **kw), "attention_logit_growth"),
    "adam_eps": (lambda get, **kw: get(runs.run_adam_eps, **kw),
                 lambda get, **kw: get(runs.run_adam_eps, eps=1e-8, **kw), "adam_eps"),
    "sgd": (lambda get, **kw: get(runs.run_sgd_blowup, **kw),
            lambda get, **kw: get(runs.run_sgd_blowup, lr=0.1, **kw), "runaway_updates"),
}


@pytest.mark.parametrize("name", NAMED)
def test_the_mechanism_is_named_live_in_the_report_and_by_diagnose(run_once, name):
    import stabletrain
    from stabletrain.debug.mechanisms.rules import MECHANISMS

    run, _, mechanism = NAMED[name]
    rows = run(run_once)
    label = MECHANISMS[mechanism].name
    # Live: one alert on the console, one row in metrics.jsonl, at a logged step.
    (event, *_) = runs.mechanism_events(rows)
    assert event["id"] == mechanism and event["step"] in {r["step"] for r in rows}
    assert f"WARNING mechanism: {label}" in rows.console
    assert event["message"] in rows.console
    if name == "sgd":  # the guard's stop says what came before the NaN
        assert f"Before it, the logged signals named {event['message']}" in str(rows.error)
    # The report: the verdict names it (a run that went non-finite stays non-finite, the mechanism beside it).
    report = stabletrain.report(rows.out, quiet=True, plots=False)
    assert report.status["signals"] == label
    assert report.verdict == ("non-finite" if name == "sgd" else label)
    assert report.mechanisms[0].start_step == event["start_step"]
    # diagnose of the run folder (no capture: the guard stopped the SGD run without nancapture).
    d = stabletrain.diagnose(rows.out, write=False)
    assert d.verdict.startswith(label) and d.mechanisms[0].detected_step == event["step"]
    assert "not verified on this run" in d.next_actions[0]


@pytest.mark.parametrize("name", NAMED)
def test_the_good_setting_names_no_mechanism(run_once, name):
    _, good, _ = NAMED[name]
    rows = good(run_once)
    assert runs.mechanism_events(rows) == [] and "WARNING mechanism" not in rows.console


def test_the_published_mitigations_remove_the_mechanism(run_once):
    assert runs.mechanism_events(run_once(runs.run_attention_growth, qk_norm=True)) == []
    assert runs.mechanism_events(run_once(runs.run_adam_eps, eps=1e-8)) == []


@pytest.mark.parametrize("every", [None, 1])
@pytest.mark.parametrize("name", NAMED)
def test_the_alert_comes_before_the_loss_is_lost(run_once, name, every):
    """Lead time: from the first alert to the step the loss stalls (5% above the good setting's, for good) or
    doubles (docs/mechanisms.md publishes both cadences: the reproduction's own, and every step)."""
    run, good, _ = NAMED[name]
    kw = {} if every is None else {"log_every_num_steps": every}
    rows, reference = run(run_once, **kw), good(run_once, **kw)
    alert = runs.mechanism_events(rows)[0]["step"]
    lost = runs.loss_lost_step(rows, reference)
    assert lost is not None and alert < lost, (alert, lost)


def test_checkpoints_after_the_mechanism_began_are_not_healthy(run_once):
    from stabletrain.runfiles.checkpoint import list_checkpoints, newest_healthy

    rows = run_once(runs.run_attention_growth, checkpoint_every_num_steps=10, max_checkpoints_to_keep=2)
    event = runs.mechanism_events(rows)[0]
    start = event["start_step"]
    folder = rows.out / "checkpoints"
    best = newest_healthy(folder)
    assert best is not None and best.step <= start  # the one from before it began, kept by rotation
    later = [c for c in list_checkpoints(folder) if c.step > start]
    assert later and not any(c.healthy for c in later)
    assert all("attention-logit growth" in c.why for c in later)
    assert f"the newest healthy checkpoint from before it: {best.path}" in rows.console
    assert "The run finished, but not stable: attention-logit growth in blocks.0.attn" in rows.console


# --------------------------------------------------------------------------------------
# b. output-logit divergence (after attention-logit growth); weight decay removes it
# --------------------------------------------------------------------------------------


def test_the_output_logits_drift_at_lr_0_5_without_weight_decay_and_weight_decay_removes_it(run_once):
    drift = run_once(runs.run_output_drift)
    named = {e["id"]: e for e in runs.mechanism_events(drift)}
    assert "output_logit_divergence" in named, [e["message"] for e in named.values()]
    output = named["output_logit_divergence"]
    # Not first: the attention failed before it, and the event says the output drift follows it.
    assert output["follows"] == "attention_logit_growth" and output["start_step"] > named[output["follows"]]["step"]
    assert min(values(drift, "signals/output_logit_mean")) < -20
    # Named in the three places, as a consequence of the attention's failure.
    import stabletrain

    assert f"WARNING mechanism: {output['message']}" in drift.console
    report = stabletrain.report(drift.out, quiet=True, plots=False)
    told = {m.id: m for m in report.mechanisms}
    assert told["output_logit_divergence"].follows == "attention_logit_growth"
    assert report.status["signals"] == "attention-logit growth"  # the first cause leads
    d = stabletrain.diagnose(drift.out, write=False)
    assert [m.id for m in d.mechanisms][:2] == ["attention_logit_growth", "output_logit_divergence"]
    decayed = run_once(runs.run_output_drift, weight_decay=0.1)
    # lr 0.5 is still too high for the attention (named there too); the output drift is gone.
    assert "output_logit_divergence" not in {e["id"] for e in runs.mechanism_events(decayed)}
    # Both runs swing to about -14 in the first 10 steps of warmup; after it, only the undecayed one drifts.
    late = [v for step, v in runs.series(decayed, "signals/output_logit_mean") if step >= 50]
    assert max(abs(v) for v in late) < 15 < 20 < -min(values(drift, "signals/output_logit_mean"))
    assert runs.final_loss(decayed) < runs.final_loss(drift) - 1.0


def test_diagnose_of_a_capture_names_the_mechanism_that_came_before_it(tmp_path):
    """The README tour's cause is the updates, not the op where the NaN appeared: diagnose of the capture
    leads with runaway updates, then says where it ended."""
    import stabletrain

    rows = runs.run_sgd_blowup(tmp_path, debug_args={"nancapture": {"enabled": True}})
    (event, *_) = runs.mechanism_events(rows)
    d = stabletrain.diagnose(rows.out / "debug" / "nan_capture" / "rank0", write=False)
    assert [m.id for m in d.mechanisms][:1] == ["runaway_updates"]
    assert d.probable_cause.startswith(f"runaway updates in decay from step {event['start_step']} (named in the "
                                       f"logged signals at step {event['step']}); the failure is where it ended: ")
    text = d.to_markdown()
    assert "## Before it failed: mechanisms in the logged signals" in text and event["message"] in text
    assert text.index("## Before it failed") < text.index("## Where")
