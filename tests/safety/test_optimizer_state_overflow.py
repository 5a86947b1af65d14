"""An optimizer state that goes non-finite while every weight stays finite: the guard stops at
that step naming the state entry, and no checkpoint holding it is written.

The realistic case: with ``precision=16-true`` the weights and AdamW's state are float16. A
gradient of about 8,100 or more (finite in float16) makes ``(1 - beta2) * g**2`` overflow, so
``exp_avg_sq`` becomes Inf while ``exp_avg`` and the weight stay finite; the update
``exp_avg / (sqrt(exp_avg_sq) + eps)`` is then 0 and that weight never moves again. Only a check
of the optimizer state sees it (docs/blowups.md: "an Inf in Adam's exp_avg_sq freezes a
parameter silently"); the parameters' check alone passes it.
"""

from __future__ import annotations

import pytest
import torch
from nan_models import samples_of_step
from torch import nn

from stabletrain.debug.grad_norm import compute_grad_norm
from stabletrain.runfiles.checkpoint import list_checkpoints, load_checkpoint
from stabletrain.safety.checkpoint_health import nonfinite_entries, verify_tensors
from stabletrain.safety.guard import NonFiniteStepError, StepGuard
from stabletrain.safety.net import NonFiniteCheckpointError
from stabletrain.training.loop import train

#: The optimizer step whose batch holds the large input (its gradient is about BIG).
BAD_STEP = 2
BIG = 12000.0


class LinearWeights(nn.Module):
    """``loss = sum |x @ w - y|``: the gradient of ``w`` is a sum of the batch's inputs (signed),
    so a sample whose ``x[0]`` is 12,000 gives ``w[0]`` a gradient of about 12,000."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), 0.5))

    def training_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (batch["x"] @ self.w - batch["y"]).abs().sum()


class PlantedData(torch.utils.data.Dataset):
    """64 samples of a linear map; ``big``: the sample whose ``x[0]`` is :data:`BIG`."""

    def __init__(self, big: int | None = None, n: int = 64):
        g = torch.Generator().manual_seed(3)
        self.x = 0.5 + torch.rand(n, 4, generator=g)  # every input positive: no gradient entry near 0
        if big is not None:
            self.x[big, 0] = BIG
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def _run(out, **settings):
    model = LinearWeights()
    victim = samples_of_step(BAD_STEP, n=64, batch_size=8)[0]
    train(out=out, model=model, data=PlantedData(big=victim), precision="16-true", steps=6, batch_size=8,
          log_every_num_steps=1, checkpoint_every_num_steps=1, num_workers=0,
          model_args={"lr": 0.01, "warmup_steps": 0}, **settings)
    return model


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def test_plain_torch_premise_exp_avg_sq_overflows_and_the_weight_freezes():
    """What the tests below rely on, in plain torch (float16 AdamW): a gradient of 12,000 leaves
    exp_avg and the weight finite, exp_avg_sq Inf, and the weight never moves again."""
    w = nn.Parameter(torch.full((4,), 0.5, dtype=torch.float16))
    opt = torch.optim.AdamW([w], lr=0.01)
    moved = []
    for g in (1.0, BIG, 1.0, 1.0):
        w.grad = torch.full((4,), g, dtype=torch.float16)
        before = w.detach().clone()
        opt.step()
        moved.append(bool((w != before).any()))
    state = opt.state[w]
    assert _finite(w) and _finite(state["exp_avg"]) and not _finite(state["exp_avg_sq"])
    assert moved == [True, False, False, False], "frozen from the large gradient's step on"


def test_trainer_stops_at_the_step_whose_optimizer_state_overflowed_and_names_the_entry(tmp_path):
    out = tmp_path / "half"
    with pytest.raises(NonFiniteStepError) as info:
        _run(out)
    err = info.value
    assert (err.step, err.stopped_at, err.origin) == (BAD_STEP, BAD_STEP, "optimizer_step")
    assert err.nonfinite == ["optimizer_state"] and err.param_names == []
    assert err.state_entries == ["w: exp_avg_sq"] and err.optimizer == "torch.optim.AdamW"
    text = str(err)
    assert f"The optimizer step of step {BAD_STEP} (rank 0 of 1) wrote non-finite values from finite gradients" in text
    assert "Optimizer state with NaN/Inf: w: exp_avg_sq." in text and "Parameters with NaN/Inf" not in text
    # Why, from what is measured: one entry of w's second moment, the float16 limit, the frozen update.
    assert ("exp_avg_sq holds 1 Inf value(s) in w while the weights are finite: the squared gradient overflowed "
            "float16 (largest value 6.55e+04; (1 - beta2) x g^2 passes it from |g| of about 1.14e+03), so the update "
            "exp_avg / (sqrt(exp_avg_sq) + eps) is 0 there") in text
    assert "train with precision=16-mixed or bf16-mixed" in text
    # Every checkpoint on disk is from before the step and finite; the one after it was never written.
    infos = list_checkpoints(out / "checkpoints")
    assert [c.step for c in infos] == list(range(1, BAD_STEP + 1))
    for c in infos:
        state = load_checkpoint(c.path)
        assert not nonfinite_entries(state), c.path


def test_trainer_with_the_guard_off_refuses_the_checkpoint_holding_the_overflowed_state(tmp_path):
    """guard.enabled=false: checkpoint verification alone must refuse the state (finite weights,
    Inf in exp_avg_sq); the previous checkpoint stays."""
    out = tmp_path / "off"
    with pytest.raises(NonFiniteCheckpointError) as info:
        _run(out, guard={"enabled": False})
    err = info.value
    assert err.step == BAD_STEP + 1 and err.entries == ["optimizer state exp_avg_sq of w"]
    assert "Refused to write the checkpoint after step 2: the state holds NaN/Inf in optimizer state exp_avg_sq of w" \
        in str(err)
    last = load_checkpoint(out / "checkpoints" / "last.ckpt")
    assert last["step"] == BAD_STEP and not nonfinite_entries(last)


def _overflowed_state() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(4, 1, bias=False).half()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for g in (1.0, BIG):
        model.weight.grad = torch.full_like(model.weight, g)
        opt.step()
    return model, opt


def test_verify_tensors_flags_the_optimizer_part_when_only_the_state_is_nonfinite():
    model, opt = _overflowed_state()
    assert _finite(model.weight), "the premise: the weights are finite"
    state = {"step": 2, "model": model.state_dict(), "optimizer": opt.state_dict()}
    model_bad, optimizer_bad, scaler_bad, weight_norm = verify_tensors(state, torch.device("cpu")).tolist()
    assert (model_bad, optimizer_bad, scaler_bad) == (0.0, 1.0, 0.0)
    assert weight_norm == pytest.approx(float(model.weight.detach().double().norm()), rel=1e-6)
    assert nonfinite_entries(state, ["weight"]) == ["optimizer state exp_avg_sq of weight"]
    # The same state with the optimizer part finite passes.
    clean = {**state, "optimizer": {"state": {0: {"exp_avg": torch.ones(4)}}, "param_groups": []}}
    assert verify_tensors(clean, torch.device("cpu")).tolist()[:3] == [0.0, 0.0, 0.0]


def test_step_guard_in_a_plain_loop_stops_at_the_state_overflow():
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False).half()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    guard = StepGuard(model, opt)
    x = torch.rand(8, 4).half() + 0.5
    with pytest.raises(NonFiniteStepError) as info:
        for step in range(5):
            scale = BIG if step == 3 else 1.0
            loss = (model(x * scale).float().sum()) / x.shape[0]
            loss.backward()
            guard.check_gradients(step, compute_grad_norm(model.named_parameters()).total, losses=[loss])
            guard.raise_if_failed(sync=False)
            opt.step()
            guard.check_update(step)
            opt.zero_grad()
            guard.raise_if_failed()
    err = info.value
    assert (err.step, err.origin, err.nonfinite) == (3, "optimizer_step", ["optimizer_state"])
    assert err.state_entries == ["weight: exp_avg_sq"] and err.param_names == []
    assert _finite(model.weight), "the weights are finite: only the state check can see it"
