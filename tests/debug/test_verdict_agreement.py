"""What the guard says, what the capture records, what replay and diagnose conclude: they agree,
for each kind of capture, and the advice fits the optimizer that ran (issue 25)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

import stabletrain
from conftest import Regression as _Regression
from conftest import tiny_lm
from stabletrain.debug import advice
from stabletrain.debug.grad_norm import compute_grad_norm
from stabletrain.safety.guard import NonFiniteStepError, StepGuard
from stabletrain.training.loop import train

NUMBER = r"([0-9.]+e[+-]?[0-9]+|[0-9.]+)"


def _optimizer_capture(out, optimizer: str, lr: float) -> NonFiniteStepError:
    with pytest.raises(NonFiniteStepError) as info:
        train(out=out, debug_args={"nancapture": {"enabled": True}},
              **tiny_lm(steps=3, model_args={"lr": lr, "optimizer": optimizer, "warmup_steps": 0}))
    return info.value


@pytest.fixture(scope="module")
def adamw_huge(tmp_path_factory):
    """AdamW at lr=1e30: step 0's update leaves every weight finite, ~1e30, beyond the range the
    guard's float32 norm check accepts."""
    out = tmp_path_factory.mktemp("agree") / "adamw"
    err = _optimizer_capture(out, "adamw", 1e30)
    return out, err


def test_huge_but_finite_update_guard_diagnose_and_replay_agree(adamw_huge):
    out, err = adamw_huge
    assert (err.step, err.origin, err.param_names, err.state_entries) == (0, "optimizer_step", [], [])
    message = str(err)
    m = re.search(r"\|w\| reaches " + NUMBER + r" in (\S+) \(", message)
    assert m, message
    value, name = m.group(1), m.group(2)
    model_max = max(float(t.abs().max()) for t in torch.load(err.capture_path, weights_only=True)["params"].values())
    assert model_max < 1e20, "the premise: the capture holds the weights from before the step"
    assert "past float32's largest value 3.4e+38, so the float32 L2 norm the guard checks overflows" in message
    assert "(one value alone does it from about 1.8e+19)" in message, "the check's threshold is stated"

    d = stabletrain.diagnose(err.capture_path, write=False)
    assert d.reproduced and d.finite_overflow and not d.nonfinite_params
    assert "NaN/Inf" not in d.verdict, "every value is finite: the verdict must not say NaN/Inf"
    assert (f"left the range the checks accept, with finite values (|w| reaches {value} in {name})" in d.verdict)
    md = d.to_markdown()
    assert "reproduces the failure: every value stays finite, but " + name in md
    assert "every parameter stays finite" not in md

    result = stabletrain.load_nan_capture(err.capture_path).replay()
    text = result.to_text()
    assert result.reproduced and result.optimizer_step is not None, text
    assert result.optimizer_step.trips[0].name == name
    assert "reproduced: YES - the optimizer step (torch.optim.AdamW)" in text
    assert "hardware" not in text and "Suspects" not in text, text


def test_adam_update_size_is_not_fixed_by_clipping(adamw_huge):
    out, err = adamw_huge
    d = stabletrain.diagnose(err.capture_path, write=False)
    actions = "\n".join(d.next_actions)
    assert "clip" not in actions.replace("clipping gradients does not bound it", ""), actions
    assert "model_args.lr=0.001 (now 1e+30; AdamW's default" in actions
    assert "clip gradients" not in str(err), "the guard's message, too"


def test_sgd_is_never_told_adamws_default_lr(tmp_path):
    err = _optimizer_capture(tmp_path / "sgd", "sgd", 1e30)
    assert err.origin == "optimizer_step"
    d = stabletrain.diagnose(err.capture_path, write=False)
    actions = "\n".join(d.next_actions)
    assert "0.001" not in actions and "default" not in actions, actions
    assert "model_args.lr=1e+29 (now 1e+30; the run's lr x0.1, not verified" in actions
    assert "clip gradients (gradient_clip_val=1.0)" in actions, "SGD's update is lr x the gradient: clipping bounds it"
    assert "0.001" not in str(err) and "not verified" in str(err)


def test_anchored_lr_depends_on_the_optimizer():
    assert advice.anchored_lr(1.0, optimizer="adamw")[0] == 0.001
    value, why = advice.anchored_lr(1.0, optimizer="sgd")
    assert value == 0.1 and "not verified" in why
    value, why = advice.anchored_lr(1.0, optimizer="mypkg.Lion")
    assert value == 0.1 and "not verified" in why
    assert advice.optimizer_family("torch.optim.AdamW") == "adam" and advice.optimizer_family("mypkg.Adam") == "other"
    assert not advice.clipping_helps("torch.optim.AdamW") and advice.clipping_helps("sgd")
    assert "unknown" in advice.update_size("mypkg.Lion")


def test_optimizer_state_overflow_is_not_blamed_on_the_weights():
    """Exploding but finite gradients (1e13 each): AdamW's second moment holds ~1e23, whose float32
    norm overflows, while its update stays ~lr. The message names the state entry and its value."""
    torch.manual_seed(0)
    model = nn.Linear(64, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = StepGuard(model, optimizer)
    loss = model(torch.randn(8, 64)).pow(2).mean()
    loss.backward()
    for p in model.parameters():
        p.grad.fill_(1e13)
    guard.check_gradients(0, compute_grad_norm(model.named_parameters()).total, losses=[loss])
    optimizer.step()
    guard.check_update(0)
    with pytest.raises(NonFiniteStepError) as info:
        guard.raise_if_failed()
    text = str(info.value)
    assert info.value.failure.nonfinite == ["optimizer_state"]
    v = float(optimizer.state[model.weight]["exp_avg_sq"].max())
    assert math.isfinite(v) and v > 1e19
    assert f"weight: exp_avg_sq reaches {v:.4g}" in text, text
    assert "made the weights so large" not in text
    largest = max(float(p.detach().abs().max()) for p in model.parameters())
    assert largest < 1 and f"|w| up to {largest:.4g}" in text
    assert "the gradients are exploding, not the weights" in text


def test_a_state_norm_overflow_below_the_one_value_threshold_says_why():
    """Issue 25, item 17, the compiled AdamW lr=1e3 run (stopped at step 28: "ln_f.bias: exp_avg_sq
    reaches 5.528e+18"): each value stays below the ~1.8e19 at which one value alone overflows the
    float32 norm, but a tensor's many squares add up past float32's largest value. The message said
    "overflows once values pass about 1.8e+19", which that value does not: it now says what summed."""
    torch.manual_seed(0)
    model = nn.Linear(64, 128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = StepGuard(model, optimizer)
    loss = model(torch.randn(8, 64)).pow(2).mean()
    loss.backward()
    for p in model.parameters():
        p.grad.fill_(7e10)  # exp_avg_sq after one step: (1 - 0.999) * 4.9e21 = 4.9e18 per value
    guard.check_gradients(0, compute_grad_norm(model.named_parameters()).total, losses=[loss])
    optimizer.step()
    guard.check_update(0)
    with pytest.raises(NonFiniteStepError) as info:
        guard.raise_if_failed()
    text = str(info.value)
    v = optimizer.state[model.weight]["exp_avg_sq"].double()
    assert v.max() < 1.8e19 < v.pow(2).sum().sqrt(), "the premise: no value alone, the sum overflows"
    assert f"weight: exp_avg_sq reaches {float(v.max()):.4g} (the squares of its 8,192 values sum to " \
           f"{float(v.pow(2).sum()):.3g}, past float32's largest value 3.4e+38" in text, text
    assert "once values pass" not in text
    assert f"needs a gradient of at least {math.sqrt(float(v.max())):.3g}" in text
    assert "the gradients are exploding, not the weights" in text and "made the weights so large" not in text


class _Poisoned(torch.utils.data.Dataset):
    """64 regression samples; sample 37 holds a NaN."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 4, generator=g)
        self.y = self.x.sum(1, keepdim=True)
        self.x[37, 2] = math.nan

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def test_bad_sample_stop_capture_replay_and_diagnose_agree(tmp_path):
    """A NaN in sample 37: the stop points at the data (not the lr), the capture says a non-finite
    loss, replay reproduces it, and diagnose names the sample."""
    from stabletrain.debug.nan_capture import NaNDetectedError

    with pytest.raises(NaNDetectedError) as info:
        train(out=tmp_path / "data", model=_Regression(), data=_Poisoned(), steps=20, batch_size=8,
              log_every_num_steps=1, checkpoint_every_num_steps=2, debug_args={"nancapture": {"enabled": True}},
              model_args={"lr": 0.01, "warmup_steps": 0})
    err = info.value
    text = str(err)
    assert err.reason == "nonfinite_loss" and text.startswith(f"Non-finite loss at step {err.step}")
    assert "on_instability.policy" in text and "skip_step" in text and "It carries model_args.lr" not in text, text
    cap = stabletrain.load_nan_capture(err.capture_path, model=_Regression())
    result = cap.replay()
    assert result.reproduced and any(37 in (ix or []) for ix in result.sample_indices)
    d = stabletrain.diagnose(err.capture_path, model=_Regression(), write=False)
    assert d.data.status == "isolated" and 37 in d.data.dataset_indices, d.data
    assert "learning rate" not in d.verdict, d.verdict


def test_a_cpu_replay_that_does_not_reproduce_does_not_suspect_gpus_or_hardware():
    from stabletrain.debug.replay import ReplayResult

    def result(captured_device: str) -> str:
        return ReplayResult(
            reproduced=False, nan_param_names=[], losses=[1.0], step=3, precision="32-true",
            captured_precision="32-true", device="cpu", captured_losses=[math.nan], losses_bitwise_equal=False,
            captured_nan_param_names=["fc.weight"], gradient_norm=1.0, microbatches=[(0, 0)], ranks=[0],
            world_size=1, missing_ranks=[], reason="nonfinite_loss", per_rank=[], path="out/x/rank0",
            captured_device=captured_device).to_text()

    on_cpu = result("cpu")
    assert "reproduced: NO" in on_cpu and "on the CPU it ran on" in on_cpu
    assert "GPU" not in on_cpu and "hardware" not in on_cpu, on_cpu
    assert "stabletrain diagnose " in on_cpu
    assert "nondeterministic GPU kernels or hardware faults" in result("cuda"), "a GPU run may still be the device"


def test_skipped_fp16_steps_stop_capture_and_diagnose_agree(tmp_path):
    """fp16 loss scaling at scale 2**20 skips every step for a while: with max_skipped_steps=3 the
    stop, the capture's reason and diagnose all say skipped steps, and the command carries the
    precision change (not a new lr)."""
    from lightning_fabric import Fabric
    from lightning_fabric.plugins import MixedPrecision

    from stabletrain.config import load_settings
    from stabletrain.debug.nan_capture import NaNDetectedError
    from stabletrain.training.loop import Trainer

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    debug = {"nancapture": {"enabled": True, "max_skipped_steps": 3}}
    settings = load_settings({"out": tmp_path / "fp16", "debug_args": debug, **tiny_lm(steps=20)})
    with pytest.raises(NaNDetectedError) as info:
        Trainer(settings, fabric=fabric).fit()
    err = info.value
    text = str(err)
    assert err.reason == "skipped_steps" and err.step == 2
    assert "It carries precision=bf16-mixed" in text and "It carries model_args.lr" not in text, text
    d = stabletrain.diagnose(err.capture_path, write=False)
    assert d.reason == "skipped_steps" and "learning rate too high" not in d.verdict, d.verdict
    assert "skip" in d.verdict or "scale" in d.verdict, d.verdict


def _rank_errors(stderr: str, world_size: int = 2) -> dict[int, str]:
    """Each rank's exception text (after ``...Error: ``), from the ``[rankN]: `` lines of a 2-process run."""
    found = {}
    for r in range(world_size):
        lines = [line[len(f"[rank{r}]: "):] for line in stderr.splitlines() if line.startswith(f"[rank{r}]: ")]
        start = next(i for i, line in enumerate(lines) if re.match(r"stabletrain\.[\w.]+Error: ", line))
        found[r] = "\n".join([lines[start].split("Error: ", 1)[1], *lines[start + 1:]])
    return found


@pytest.mark.slow
@pytest.mark.parametrize("nancapture", [True, False], ids=["nancapture", "guard"])
def test_another_ranks_failure_every_rank_capture_and_diagnose_agree(tmp_path, nancapture):
    """DDP on 2 processes, a NaN in one sample of rank 1's data at step 2. Rank 0's own loss is finite;
    DDP averages rank 1's NaN gradients into its. Each rank used to report what it saw: rank 1 a
    non-finite loss with the data advice, rank 0 non-finite gradients with a lower lr. Now every rank
    reports rank 1's message; the capture's reasons say what each rank saw; diagnose of all ranks
    leads with rank 1's loss and names the sample, and of rank 0 alone says another rank's step failed
    (not a hardware fault)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from nan_models import samples_of_step

    from conftest import cli_env

    script = Path(__file__).with_name("nan_models.py")
    proc = subprocess.run([sys.executable, str(script), "run", "2", *([] if nancapture else ["guard"])],
                          cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    errors = _rank_errors(proc.stderr)
    assert errors[0] == errors[1], "the two ranks name one cause"
    head = "Non-finite loss at step 2 (rank 1 of 2)" if nancapture else \
        "Non-finite loss and gradient norm at step 2 (rank 1 of 2)"
    message = errors[0]
    assert message.startswith(head), message
    assert "on_instability.policy=skip_step" in message and "It carries model_args.lr" not in message, message
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if '"event"' in line]
    if not nancapture:
        (row,) = [e for e in events if e["event"] == "nonfinite_step"]
        assert row["step"] == 2
        return
    folder = tmp_path / "run" / "debug" / "nan_capture"
    reasons = {r: torch.load(folder / f"rank{r}" / "nan_capture.pt", weights_only=True)["reason"] for r in (0, 1)}
    assert reasons == {0: "nonfinite_gradients", 1: "nonfinite_loss"}
    victim = samples_of_step(2, world_size=2, rank=1)[1]
    from nan_models import PoisonNet

    d = stabletrain.diagnose(folder, model=PoisonNet(), write=False)
    assert d.reason == "nonfinite_loss"
    assert f"bad data: batch['x'] of sample {victim} holds 1 non-finite value" in d.verdict, d.verdict
    assert ("on a non-finite loss on rank 1 (rank 0: non-finite gradients, averaged in from the gradients of the "
            "ranks whose loss was non-finite)") in d.summary, d.summary
    alone = stabletrain.diagnose(folder / "rank0", model=PoisonNet(), write=False)
    assert alone.probable_cause == "another rank's step failed; this rank only stopped with it", alone.verdict
    assert "hardware" not in alone.verdict and "hardware" not in alone.cause_explanation
    assert alone.next_actions == [f"Diagnose all ranks together: stabletrain diagnose {folder}"]


def test_a_mechanism_named_before_a_resume_is_in_the_verdict_of_the_report_and_of_diagnose(tmp_path):
    """Attention-logit growth named at step 90 in a timeline that a resume from step 75 replaced, none named
    since: the report's verdict named it and diagnose said "no mechanism named in the logged signals". Both
    name it now, as named before the resume, and neither advises its fix (the resumed run is another one)."""
    import json

    event = {"event": "mechanism", "step": 90, "id": "attention_logit_growth", "name": "attention-logit growth",
             "where": "blocks.0.attn", "start_step": 20, "detected_step": 90, "end_step": None,
             "evidence": "signals/attn_logit_max/blocks.0.attn 1.04e+03 (0.232 at step 0)", "values": {},
             "follows": "", "episode": 1}
    lines = [{"step": s, "loss": 3.0 - s / 100} for s in range(0, 100, 10)] + [event]
    lines += [{"event": "resume", "step": 75, "checkpoint": "x"}] + [{"step": s, "loss": 2.0} for s in range(80, 150, 10)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    r = stabletrain.report(tmp_path, quiet=True, plots=False)
    d = stabletrain.diagnose(tmp_path, write=False)
    assert r.verdict == "attention-logit growth"
    assert d.verdict == ("attention-logit growth in blocks.0.attn, named before the resume from step 75, whose "
                         "timeline replaced it; none named in the logged signals since")
    assert "(from step 20, found at step 90; before the resume from step 75, whose timeline replaced it)" in str(d)
    assert d.next_actions == [] and "\nnext:" not in r.text
