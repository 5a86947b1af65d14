"""The rules that name a mechanism from logged rows (stabletrain.debug.mechanisms.rules), on hand-written rows:
each fires where its rule holds and not where one of its conditions fails (the cases where the name would be
false), and the fixes follow the run's settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from stabletrain.config import MechanismArgs
from stabletrain.debug.mechanisms.rules import (
    MECHANISMS,
    Mechanism,
    MechanismDetector,
    RuleContext,
    detect_mechanisms,
    merge_episodes,
    published_fixes,
    starts_over,
)

A = "signals/attn_logit_max"
H = "signals/attn_entropy"


def attention_rows(logits: list[float], entropies: list[float], every: int = 10) -> list[dict]:
    return [{"step": i * every, "loss": 3.0, f"{A}/blocks.0.attn": lg, f"{H}/blocks.0.attn": h,
             A: lg, "signals/attn_entropy_min": h} for i, (lg, h) in enumerate(zip(logits, entropies))]


def test_attention_logit_growth_needs_both_a_large_logit_and_a_collapsed_entropy():
    # The logit rises past 10 (a fifth of the limit) at step 20, the rule holds at steps 30 and 40.
    rows = attention_rows([0.05, 3, 12, 80, 200, 300], [1.9, 1.8, 1.2, 0.05, 0.02, 0.01])
    (m,) = detect_mechanisms(rows)
    assert (m.id, m.where, m.start_step, m.detected_step) == ("attention_logit_growth", "blocks.0.attn", 20, 40)
    assert "200 (0.05 at step 0)" in m.evidence and "0.02 nats" in m.evidence
    # Large logits with a spread-out attention (a legitimately sharp head among many keys): no name.
    assert detect_mechanisms(attention_rows([0.05, 80, 200, 300], [1.9, 0.5, 0.4, 0.3])) == []
    # A collapsed entropy with moderate logits (a copy head, logits ~20): no name either.
    assert detect_mechanisms(attention_rows([0.05, 20, 22, 21], [1.9, 0.03, 0.02, 0.02])) == []
    # One point alone is not enough (persist 2), unless the settings say 1.
    single = attention_rows([0.05, 3, 200, 4, 3], [1.9, 1.8, 0.01, 1.5, 1.6])
    assert detect_mechanisms(single) == []
    assert [m.detected_step for m in detect_mechanisms(single, MechanismArgs(persist=1))] == [20]


def test_a_mechanism_stays_open_while_its_rule_holds_and_closes_after_persist_misses():
    rows = attention_rows([0.05, 80, 90, 95, 5, 4, 90, 95], [1.9, 0.05, 0.04, 0.04, 1.5, 1.6, 0.03, 0.03])
    detector = MechanismDetector()
    named, closed = [], []
    for r in rows:
        named += [(r["step"], m.detected_step) for m in detector.update(r["step"], r)]
        closed += [(r["step"], m.end_step) for m in detector.closed_now]
    assert named == [(20, 20), (70, 70)]  # named again after it closed
    assert closed == [(50, 30)]  # closed at step 50 (2 misses), it held last at step 30
    first, second = detector.found
    assert first.end_step == 30 and second.open and detector.open() == [second]
    assert (first.episode, second.episode) == (1, 2)
    # The second time is one line (its fixes were printed the first time), and its row says which time it is.
    from stabletrain.debug.mechanisms.alerts import alert_text

    assert "\n" in alert_text(first) and "next (the published fix" in alert_text(first)
    assert alert_text(second) == f"WARNING mechanism again (the 2nd time): {second.describe()}."
    back = Mechanism.from_event(second.to_event())
    assert back is not None and back.episode == 2
    # A report or a diagnosis tells it once: the first episode, then how often it came back and until when.
    (told,) = merge_episodes(detector.found)
    assert told is first and told.repeats == [second]
    assert "from step 10, found at step 20, until step 30; named again once, from step 60 and still open" in told.describe()


def eps_row(step: int, fraction: float, update_rms: float, weight_rms: float = 0.02, lr: float = 0.01) -> dict:
    return {"step": step, "loss": 5.0, "lr": lr, "signals/adam_eps_fraction": fraction,
            "signals/update_rms/decay": update_rms, "signals/weight_rms/decay": weight_rms}


def test_the_adam_eps_regime_needs_damped_updates_not_only_a_large_fraction():
    # eps 1: every entry below eps, and the update RMS is 0.0006 * 0.02 / 0.002 = 0.006 of the lr.
    (m,) = detect_mechanisms([eps_row(0, 1.0, 0.0006, lr=0.002)], context=RuleContext(eps=1.0))
    assert (m.id, m.start_step, m.detected_step) == ("adam_eps", 0, 0)  # one point suffices
    assert "100% of the second-moment entries are below eps (eps=1)" in m.evidence
    assert "0.006 x the lr" in m.evidence
    # A large vocabulary whose unseen rows have v = 0 (fraction 0.8) but normal updates: not the eps regime.
    assert detect_mechanisms([eps_row(0, 0.8, 0.1, lr=0.002)]) == []
    # A small fraction: not either.
    assert detect_mechanisms([eps_row(0, 0.2, 0.0006, lr=0.002)]) == []


def runaway_rows(updates, weights, losses) -> list[dict]:
    return [{"step": i, "loss": ls, "lr": 1.0, "signals/update_rms/decay": u, "signals/weight_rms/decay": w}
            for i, (u, w, ls) in enumerate(zip(updates, weights, losses))]


def test_runaway_updates_need_large_updates_growing_weights_and_a_rising_loss():
    # SGD at lr 1 (the README tour's shape): the loss rises from step 3 while the weights grow.
    rows = runaway_rows([0.07, 0.22, 0.48, 0.78, 0.72, 0.46], [0.019, 0.020, 0.024, 0.033, 0.048, 0.065],
                        [5.55, 5.36, 4.59, 4.83, 6.01, 6.07])
    (m,) = detect_mechanisms(rows)
    assert (m.id, m.where, m.start_step, m.detected_step) == ("runaway_updates", "decay", 4, 5)
    assert "signals/update_rms/decay 0.46" in m.evidence and "3.42x its 0.019 at step 0" in m.evidence
    # AdamW's first steps at a high lr: large relative updates, growing weights, but a falling loss.
    falling = runaway_rows([0.9, 0.98, 0.81, 0.55, 0.39], [0.025, 0.04, 0.068, 0.10, 0.14],
                           [5.55, 5.24, 4.09, 3.23, 3.03])
    assert detect_mechanisms(falling) == []
    # A loss spike with small updates: not runaway updates either.
    spike = runaway_rows([0.01] * 5, [0.02, 0.05, 0.06, 0.07, 0.08], [5, 4, 9, 9, 9])
    assert detect_mechanisms(spike) == []


def test_output_logit_divergence_is_a_drift_of_the_logits_common_level():
    mean, lse = "signals/output_logit_mean", "signals/output_logsumexp"
    drift = [{"step": i * 10, "loss": 3.0, mean: v, lse: 5.5} for i, v in enumerate([0.0, -8, -15, -25, -40, -60])]
    (m,) = detect_mechanisms(drift)
    assert (m.id, m.start_step, m.detected_step) == ("output_logit_divergence", 30, 40)
    assert "signals/output_logit_mean -40 (0 at step 0), log Z 5.5, at a loss of 3" in m.evidence
    # A confident classifier: log Z and the largest logit grow, the common level does not: no name.
    confident = [{"step": i, "loss": 0.01, mean: -2.0, lse: v, "signals/output_logit_absmax": v}
                 for i, v in enumerate([2.3, 20, 40, 60])]
    assert detect_mechanism_ids(confident) == []
    # A level that starts far from 0 and stays there (a model's own bias) did not drift: no name.
    assert detect_mechanism_ids([{"step": i, mean: 50.0 + i} for i in range(5)]) == []


def detect_mechanism_ids(rows: list[dict]) -> list[str]:
    return [m.id for m in detect_mechanisms(rows)]


def test_a_stale_second_moment_is_a_jump_of_the_update_after_a_calm_stretch():
    calm = [{"step": i, "loss": 2.0, "signals/update_rms_max": 0.01, "signals/adam_eps_fraction": 0.1}
            for i in range(12)]
    jump = {"step": 12, "loss": 6.0, "signals/update_rms_max": 0.2, "signals/adam_eps_fraction": 0.1}
    (m,) = detect_mechanisms([*calm, jump], context=RuleContext(betas=[0.9, 0.999]))
    assert (m.id, m.detected_step) == ("stale_second_moment", 12)
    assert "20x its median 0.01" in m.evidence and "beta2=0.999" in m.evidence
    # Not Adam (no adam_eps_fraction logged: SGD): no name.
    sgd = [{k: v for k, v in r.items() if k != "signals/adam_eps_fraction"} for r in [*calm, jump]]
    assert detect_mechanisms(sgd) == []
    # The same jump without a loss spike: no name.
    assert detect_mechanisms([*calm, {**jump, "loss": 2.1}]) == []


def test_the_float16_range_only_under_float16():
    rows = [{"step": i, "loss": 2.0, A: v} for i, v in enumerate([10, 20000, 30000])]
    (m,) = detect_mechanisms(rows, context=RuleContext(precision="16-mixed"))
    assert (m.id, m.detected_step) == ("fp16_range", 2)
    assert detect_mechanisms(rows, context=RuleContext(precision="bf16-mixed")) == []
    scale = [{"step": i, "loss": 2.0, "loss_scale": s} for i, s in enumerate([65536.0, 1.0, 0.5])]
    assert [m.id for m in detect_mechanisms(scale, context=RuleContext(precision="16-mixed"))] == ["fp16_range"]


def test_a_mechanism_named_while_another_is_open_follows_it():
    rows = runaway_rows([0.07, 0.22, 0.48, 0.78, 0.72, 0.46, 0.5, 0.5], [0.019, 0.02, 0.024, 0.033, 0.048, 0.065,
                                                                        0.09, 0.12], [5.55, 5.36, 4.59, 4.83, 6.01,
                                                                                      6.07, 7, 8])
    for r, (lg, h) in zip(rows[5:], [(100, 0.01), (200, 0.0), (300, 0.0)]):
        r.update({f"{A}/blocks.0.attn": lg, f"{H}/blocks.0.attn": h})
    first, second = detect_mechanisms(rows)
    assert first.id == "runaway_updates" and not first.follows
    assert second.id == "attention_logit_growth" and second.follows == "runaway_updates"
    assert "it follows runaway updates, most likely as its consequence" in second.describe()


def test_the_event_row_round_trips():
    (m,) = detect_mechanisms(attention_rows([0.05, 80, 200], [1.9, 0.05, 0.02]))
    event = m.to_event()
    assert event["event"] == "mechanism" and event["step"] == 20 and event["name"] == "attention-logit growth"
    back = Mechanism.from_event(event)
    assert back is not None and back.describe() == m.describe()
    assert Mechanism.from_event({"event": "mechanism", "id": "not_a_mechanism", "step": 1}) is None


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fixes_follow_the_optimizer_and_the_task(optimizer):
    c = RuleContext(lr=0.5, optimizer=optimizer, task="language_model", warmup_steps=10, eps=1e-8,
                    betas=[0.9, 0.999], weight_decay=0.0)
    runaway = published_fixes("runaway_updates", c)
    assert runaway[0].startswith("a lower lr: model_args.lr=0.15 (x0.3")  # the run's own lr, not a default
    assert all("0.001" not in f for f in runaway)
    clipping = any("gradient_clip_val" in f for f in runaway)
    assert clipping == (optimizer == "sgd")  # clipping does not bound Adam's update
    assert published_fixes("stale_second_moment", c)[0] == "a lower beta2: model_args.betas=[0.9, 0.95] (now 0.999)"
    attention = published_fixes("attention_logit_growth", c)
    assert "model_args.qk_norm=true" in attention[0] and starts_over(attention[0]) and not starts_over(attention[1])
    # A model of the user's own has no model_args.qk_norm: the fix is described, not a setting.
    own = published_fixes("attention_logit_growth", RuleContext(lr=0.5, task="custom"))
    assert "model_args" not in own[0]
    assert published_fixes("adam_eps", RuleContext(eps=1.0)) == ["a lower eps: model_args.eps=1e-08 (now 1)"]


def test_the_docs_table_names_every_mechanism_with_its_rule_and_fix():
    text = (Path(__file__).parents[3] / "docs" / "mechanisms.md").read_text(encoding="utf-8")
    for m in MECHANISMS.values():
        row = next((line for line in text.splitlines() if line.startswith(f"| {m.name} |")), None)
        assert row is not None, m.name
        assert m.rule in row and m.fix in row and m.reference in row, m.name


def test_rows_without_signals_name_nothing():
    rows = [{"step": i, "loss": 5.0 - i * 0.1, "gradient_norm": 1.0} for i in range(30)]
    assert detect_mechanisms(rows) == []
