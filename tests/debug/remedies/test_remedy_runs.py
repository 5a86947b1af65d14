"""Remedies verified on the real, unplanted reproductions of tests/mechanism_runs.py: the candidates re-run
from the run's checkpoint with the trainer, ranked, the best compared with an lr sweep from the same start
(stabletrain.verify_remedies).

Every run here uses one torch thread, as the reproductions do: a re-run is then bitwise the original run
(same start, same data order), which the tests check."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Callable

import mechanism_runs as runs
import pytest
import torch

from stabletrain.debug.remedies import FILE_JSON, FILE_MD, SCRATCH
from stabletrain.reporting.remedies import verify_remedies
from stabletrain.runfiles.checkpoint import newest_healthy
from stabletrain.runfiles.history import read_run

# Every 2 steps: the runaway updates begin at step 4, and the checkpoint of step 4 is the newest healthy one.
CHECKPOINTS = {"checkpoint_every_num_steps": 2, "max_checkpoints_to_keep": 100}


@pytest.fixture(scope="module")
def run_once(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., runs.Rows]:
    """Each distinct run once per module."""
    cache: dict[tuple, runs.Rows] = {}

    def get(fn: Callable[..., runs.Rows], **kw: Any) -> runs.Rows:
        key = (fn.__name__, json.dumps(kw, sort_keys=True))
        if key not in cache:
            cache[key] = fn(tmp_path_factory.mktemp(fn.__name__), **kw)
        return cache[key]

    return get


def verify(run: Path, **kw: Any):
    """verify_remedies on one torch thread (as the runs were made), progress lines kept."""
    lines: list[str] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = verify_remedies(run, progress=lines.append, **kw)
    finally:
        torch.set_num_threads(threads)
    report.lines = lines  # type: ignore[attr-defined]
    return report


def losses_at(rows: list[dict], steps: list[int]) -> list[float]:
    by_step = {r["step"]: r["loss"] for r in rows}
    return [by_step[s] for s in steps]


def first_nonfinite(rows: runs.Rows) -> int:
    bad = [e["step"] for e in rows.events if e.get("event") == "nonfinite_step"]
    logged = runs.first_nonfinite(rows)
    return min(bad + ([logged] if logged is not None else []))


# ----------------------------------------------------------------------------------- SGD lr 1


def test_sgd_blowup_candidates_run_from_the_newest_healthy_checkpoint_and_the_lr_one_is_verified(run_once):
    rows = run_once(runs.run_sgd_blowup, **CHECKPOINTS)  # the README tour: SGD at lr 1, NaN at step ~31
    assert rows.error is not None
    failed = first_nonfinite(rows)
    report = verify(rows.out)
    plan = report.plan
    assert plan.failed_step == failed and plan.since_step is not None and plan.since_step <= failed
    healthy = newest_healthy(rows.out / "checkpoints", before_step=plan.since_step - 1)
    assert healthy is not None and healthy.healthy and plan.start_checkpoint == healthy.path
    assert plan.start_step == healthy.step < failed < plan.end_step <= 100  # through the failure and past it

    # The run as it was, re-run from the checkpoint: non-finite at the same step (bitwise resume, same data).
    assert report.baseline.source == "re-run" and report.baseline.nonfinite_step == failed
    assert not any("does not repeat" in n for n in report.notes)

    # Every re-run resumed from that checkpoint, except those tried from step 0 (qk_norm adds weights).
    for o in report.ranked:
        resumes = [e for e in read_run(o.folder / "metrics.jsonl").events if e["event"] == "resume"]
        if o.from_step:
            assert [e["checkpoint"] for e in resumes] == [str(healthy.path)], o.name
        else:
            assert o.candidate.from_start and not resumes

    # The lr candidates: the run's own lr x0.3 and x0.1 (never AdamW's 0.001), both finite, ranked by loss.
    lrs = {o.candidate.overrides["model_args.lr"]: o for o in report.ranked if "model_args.lr" in o.candidate.overrides}
    # 0.1 trained best of the two, so the next one down (0.03) is tried too, and trains worse: 0.1 is bracketed.
    assert sorted(lrs) == [0.03, 0.1, 0.3] and "the next one down" in lrs[0.03].candidate.why
    assert all(o.status == "finite" and o.steps_run == plan.end_step - plan.start_step for o in lrs.values())
    order = [o.name for o in report.ranked]
    assert order.index("model_args.lr=0.1") < order.index("model_args.lr=0.3")
    assert lrs[0.1].final_loss < min(lrs[0.3].final_loss, lrs[0.03].final_loss)
    assert not any(o.candidate.overrides.get("model_args.lr") == 0.001 for o in report.ranked)

    # The verified remedy: lr 0.1 trains (its final loss below its start) where the run went NaN.
    assert report.best is not None and report.best.name == "model_args.lr=0.1" and report.best.trains
    action = report.next_action()
    assert action.startswith("Resume with model_args.lr=0.1 (verified: final loss ")
    assert f"where the run as it was went non-finite at step {failed}" in action
    assert f"resume_from={healthy.path}" in action and action.endswith(" model_args.lr=0.1")
    assert " model_args.lr=1 " not in action  # the run's lr is replaced, not repeated

    # One progress line per re-run, then the cost.
    progress = [line for line in report.lines if line.startswith("[")]
    assert len(progress) == 1 + len(report.ranked) and progress[0].startswith("[1/") and "] as run: " in progress[0]
    assert progress[-1].startswith(f"[{len(progress)}/{len(progress)}] model_args.lr=0.03: ")  # the next lr down, added last
    assert report.lines[-1].startswith(f"verification cost: {report.steps} steps = ")
    assert report.steps == report.baseline.steps_run + sum(o.steps_run for o in report.ranked)

    # Written and read back.
    folder = rows.out / SCRATCH
    written = json.loads((folder / FILE_JSON).read_text())
    assert written["best"] == "model_args.lr=0.1" and written["baseline"]["nonfinite_step"] == failed
    assert [r["candidate"]["name"] for r in written["ranked"]] == order
    assert written["ranked"][0]["command"] == report.commands["model_args.lr=0.1"]
    assert (folder / FILE_MD).read_text().startswith(f"# Verified remedies: {rows.out}")


def test_a_budget_is_respected_and_the_run_files_are_not_touched(run_once):
    rows = run_once(runs.run_sgd_blowup, **CHECKPOINTS)
    own = [p for p in rows.out.rglob("*") if p.is_file() and SCRATCH.parts[0] not in p.relative_to(rows.out).parts]
    assert {"metrics.jsonl", "settings.json", "train.log", "last.ckpt"} <= {p.name for p in own}
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in own}
    from stabletrain.debug.remedies import make_plan

    plan = make_plan(rows.out)  # the as-run re-run stops at the failure; a candidate runs the whole stretch
    as_run, one = plan.failed_step - plan.start_step + 1, plan.end_step - plan.start_step
    budget = as_run + one + one // 2  # room for one candidate, not two
    report = verify(rows.out, budget_steps=budget)
    after = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in own}
    assert after == before  # checkpoints, metrics.jsonl, settings.json, train.log: byte for byte
    new = {p for p in rows.out.rglob("*") if p.is_file()} - set(own)
    assert new and all(p.relative_to(rows.out).parts[:2] == SCRATCH.parts for p in new)

    assert report.steps <= budget
    assert report.baseline.steps_run == as_run and len(report.ranked) == 1
    assert report.not_tried and all(f"of budget_steps={budget} left" in why for _, why in report.not_tried)
    tried = {report.ranked[0].name}
    assert [c.name for c, _ in report.not_tried] == [c for c in _names(report) if c not in tried]
    assert sum("not tried (needs" in line for line in report.lines) == len(report.not_tried)
    assert "Not tried (budget): " in report.to_markdown()


def _names(report) -> list[str]:
    from stabletrain.debug.remedies import candidates_for

    plan = report.plan  # the run's mechanisms (runaway updates here), then the non-finite step
    mechanisms = [*plan.mechanisms, *(["nonfinite"] if plan.failed_step is not None else [])]
    return [c.name for c in candidates_for(plan.settings, mechanisms)]


# ------------------------------------------------------------------------- attention-logit growth


def test_attention_growth_remedy_is_within_5_percent_of_the_best_lr_of_a_sweep(run_once, tmp_path):
    settings = {"steps": 100, "checkpoint_every_num_steps": 10}
    rows = run_once(runs.run_attention_growth, **settings)
    onset = runs.first_departure(rows, "signals/attn_logit_max", factor=100)  # what a mechanism rule sees
    report = verify(rows.out, since_step=onset, mechanisms=["attention_logit_growth"], budget_steps=400)
    plan = report.plan
    assert [c.name for c, _ in report.not_tried][:1] == ["model_args.eps=1e-10"]  # the budget: the 4 relevant ones
    assert {o.name for o in report.ranked} == {"model_args.qk_norm=true", "model_args.lr=0.03", "model_args.lr=0.01",
                                               "model_args.warmup_steps=20"}
    assert report.best is not None

    # The sweep, run independently from the same start: the run's lr x1, x0.3, x0.1, x0.03, x0.01.
    start = {} if plan.start_checkpoint is None else {"resume_from": plan.start_checkpoint}
    sweep = {1.0: losses_at(rows, plan.eval_steps)}
    for factor in (0.3, 0.1, 0.03, 0.01):
        again = runs.run_attention_growth(tmp_path, lr=0.1 * factor, **settings, **start)
        sweep[factor] = losses_at(again, plan.eval_steps)
    finals = {f: sum(v) / len(v) for f, v in sweep.items()}
    assert report.best.final_loss <= 1.05 * min(finals.values()), (report.best.name, finals)
    assert report.best.final_loss < finals[1.0] - 0.2  # and far better than the run as it was

    # The verification's re-runs are the sweep's runs, bitwise: same start, same data order.
    by_name = {o.name: o for o in report.ranked}
    assert [v for _, v in by_name["model_args.lr=0.03"].final_losses] == sweep[0.3]
    assert [v for _, v in by_name["model_args.lr=0.01"].final_losses] == sweep[0.1]
    # The signals at the end show the mechanism gone with the remedy and there without it.
    assert report.best.signals["signals/attn_logit_max"] < report.baseline.signals["signals/attn_logit_max"] / 10


# ----------------------------------------------------------------------------- Adam eps regime


def test_adam_eps_regime_remedy_lowers_eps_and_trains(run_once):
    rows = run_once(runs.run_adam_eps, checkpoint_every_num_steps=10)  # AdamW with eps 1: barely trains
    report = verify(rows.out, mechanisms=["adam_eps"], budget_steps=300)
    assert report.best is not None, report.to_markdown()
    best = report.best
    assert best.candidate.overrides == {"model_args.eps": 1e-8} and best.trains
    assert best.final_loss < report.baseline.final_loss - 1.0  # documented: 2.6 against 4.7
    assert best.signals["signals/adam_eps_fraction"] < 0.5 <= report.baseline.signals["signals/adam_eps_fraction"]
    assert report.next_action().split(" (")[0] in ("Resume with model_args.eps=1e-08",
                                                    "Start again with model_args.eps=1e-08")


# ------------------------------------------------------------------------------- a healthy run


def test_a_healthy_run_has_no_verified_remedy(run_once):
    rows = run_once(_healthy)
    report = verify(rows.out)
    assert report.plan.baseline_covered and report.baseline.source == "original rows"
    assert report.baseline.steps_run == 0 and report.baseline.final_loss == pytest.approx(
        sum(losses_at(rows, report.plan.eval_steps)) / len(report.plan.eval_steps))
    assert len(report.ranked) >= 6 and not report.not_tried  # every candidate tried
    assert report.best is None
    assert str(report).startswith(f"No verified remedy: none of the {len(report.ranked)} candidates tried beat the "
                                  "run as it was")
    for o in report.ranked:
        ok, gain, threshold = report.compared(o)
        assert not ok and (gain <= threshold or math.isnan(gain)), o.name


def _healthy(tmp_path: Path) -> runs.Rows:
    """The tiny model at the default lr: 60 steps, logged every 10, checkpoints every 20."""
    return runs.run_lm(tmp_path / "healthy", steps=60, log_every_num_steps=10, checkpoint_every_num_steps=20)
