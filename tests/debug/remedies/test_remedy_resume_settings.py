"""Each setting a remedy changes takes effect when the run resumes from its checkpoint: the lr, AdamW's eps and
betas, the warmup and gradient clipping. The first step after the resume, made by the settings the verification
gives the trainer (TrainerRunner), is recomputed in float64 from the checkpoint's optimizer state and the step's
gradients, with the new value and with the old one: it matches the new one only."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mechanism_runs as runs
import pytest
import torch

import stabletrain
from stabletrain.debug.remedies import Candidate, RunRequest, make_plan
from stabletrain.reporting.remedies import TrainerRunner

START = 10
#: The run resumed from: AdamW with an eps and betas whose change shows in one step, cosine after warmup 5.
RUN = {"steps": 20, "log_every_num_steps": 1, "checkpoint_every_num_steps": 10, "model_args": {
    "lr": 0.01, "eps": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1, "warmup_steps": 5}}


class Recorder:
    """The first step after the resume: weights, gradients (after clipping), AdamW state and hyperparameters
    before the optimizer step, weights after it, and the gradient norm before clipping."""

    def __init__(self) -> None:
        self.before: dict[str, Any] = {}
        self.after: dict[str, torch.Tensor] = {}

    def on_after_backward(self, trainer: Any, *, step: int, grad_norm: Any) -> None:
        if step == START:
            self.before["raw_norm"] = float(grad_norm.total)

    def on_before_optimizer_step(self, trainer: Any, *, step: int) -> None:
        if step != START:
            return
        opt = trainer.optimizer
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        self.before["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        self.before["params"] = {}
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state[p]
                self.before["params"][names[id(p)]] = {
                    "w": p.detach().double().clone(), "g": p.grad.detach().double().clone(),
                    "m": state["exp_avg"].double().clone(), "v": state["exp_avg_sq"].double().clone(),
                    "t": float(state["step"]), "group": group["name"]}

    def on_after_optimizer_step(self, trainer: Any, *, step: int) -> None:
        if step == START:
            self.after = {n: p.detach().double().clone() for n, p in trainer.model.named_parameters()}


def adamw(entry: dict[str, Any], lr: float, betas: tuple[float, float], eps: float, wd: float) -> torch.Tensor:
    """torch.optim.AdamW's step, in float64."""
    b1, b2 = betas
    t = entry["t"] + 1
    m = b1 * entry["m"] + (1 - b1) * entry["g"]
    v = b2 * entry["v"] + (1 - b2) * entry["g"] ** 2
    denom = v.sqrt() / math.sqrt(1 - b2 ** t) + eps
    return entry["w"] * (1 - lr * wd) - lr / (1 - b1 ** t) * m / denom


def cosine(step: int, warmup: int, steps: int, floor: float = 0.1) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / (steps - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return runs.run_lm(tmp_path_factory.mktemp("resume") / "run", **RUN).out


def resumed(run: Path, tmp_path: Path, overrides: dict[str, Any]) -> Recorder:
    """Resume ``run`` from step 10 with ``overrides`` through the verification's runner settings, 2 steps."""
    plan = make_plan(run, start=START)
    runner = TrainerRunner(plan)
    settings = runner.settings_for(RunRequest(Candidate("c", overrides, "test"), tmp_path / "c",
                                              plan.start_checkpoint, START + 2))
    recorder = Recorder()
    settings["callbacks"].append(recorder)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        stabletrain.train(out=tmp_path / "c", **settings)
    finally:
        torch.set_num_threads(threads)
    assert recorder.after, "the resumed run made no step"
    return recorder


def check_step(rec: Recorder, lr: float, betas: tuple[float, float], eps: float, wd_decay: float) -> float:
    """The largest difference between the step made and float64 AdamW with these hyperparameters."""
    worst = 0.0
    for name, entry in rec.before["params"].items():
        wd = wd_decay if entry["group"] == "decay" else 0.0
        expected = adamw(entry, lr, betas, eps, wd)
        worst = max(worst, float((rec.after[name] - expected).abs().max()))
    return worst


TOL = 2e-6  # float32 arithmetic of weights of magnitude up to about 1


@pytest.mark.parametrize("overrides, new, old", [
    ({"model_args.lr": 0.003}, {"lr": 0.003}, {"lr": 0.01}),
    ({"model_args.eps": 1e-8}, {"eps": 1e-8}, {"eps": 1e-2}),
    ({"model_args.betas": [0.8, 0.9]}, {"betas": (0.8, 0.9)}, {"betas": (0.9, 0.95)}),
    ({"model_args.warmup_steps": 40}, {"warmup": 40}, {"warmup": 5}),
])
def test_adamw_settings_take_effect_on_resume(run, tmp_path, overrides, new, old):
    rec = resumed(run, tmp_path, overrides)

    def hyper(values: dict[str, Any]) -> dict[str, Any]:
        base = values.get("lr", 0.01)
        factor = cosine(START, values.get("warmup", 5), RUN["steps"])
        return {"lr": base * factor, "betas": values.get("betas", (0.9, 0.95)), "eps": values.get("eps", 1e-2)}

    now, before = hyper(new), hyper(old)
    group = rec.before["groups"][0]
    assert group["lr"] == pytest.approx(now["lr"], rel=1e-12)  # the schedule of the new settings
    assert tuple(group["betas"]) == pytest.approx(now["betas"]) and group["eps"] == now["eps"]
    assert check_step(rec, now["lr"], now["betas"], now["eps"], 0.1) < TOL
    assert check_step(rec, before["lr"], before["betas"], before["eps"], 0.1) > 50 * TOL  # the old value: not it


def test_gradient_clipping_takes_effect_on_resume(run, tmp_path):
    rec = resumed(run, tmp_path, {"gradient_clip_val": 0.01})
    raw = rec.before["raw_norm"]
    assert raw > 0.1  # well above the threshold: clipping acts
    clipped = math.sqrt(sum(float((e["g"] ** 2).sum()) for e in rec.before["params"].values()))
    assert clipped == pytest.approx(0.01, rel=1e-4)
    lr = 0.01 * cosine(START, 5, RUN["steps"])
    assert check_step(rec, lr, (0.9, 0.95), 1e-2, 0.1) < TOL  # the step used the clipped gradients
    unclipped = {n: {**e, "g": e["g"] * raw / clipped} for n, e in rec.before["params"].items()}
    rec.before["params"] = unclipped
    assert check_step(rec, lr, (0.9, 0.95), 1e-2, 0.1) > 50 * TOL
