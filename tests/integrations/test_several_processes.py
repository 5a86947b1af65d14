"""What the integrations' StepTools do with several processes, one process playing rank r of 2 (the
collectives of an uninitialised process group are the identity; tests/integrations/test_accelerate.py,
test_lightning.py and test_transformers.py run two):

* the guard's check after the optimizer step, agreed over ranks a step later (on the next step's first
  collective read, or by an asynchronous all-reduce read at the next step's end), and the last step's
  by ``finish``;
* what the mechanism signals cannot measure, said once by rank 0.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import plant_exp_avg_sq_overflow
from stabletrain import NonFiniteStepError
from stabletrain.integrations.common import StepTools
from stabletrain.integrations.device_reads import LaggedAgreement
from stabletrain.utils.sync import CountSyncs


def make(tmp_path, *, world_size=2, nancapture=True, plant_at=2, underflow_overflow=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plant_exp_avg_sq_overflow(optimizer, at_step=plant_at)
    tools = StepTools(model, framework="accelerate", out_dir=tmp_path, rank=0, world_size=world_size,
                      optimizer=optimizer, debug_args={"nancapture": {"enabled": nancapture},
                                                       "underflow_overflow": {"enabled": underflow_overflow}},
                      trend_alerts={"enabled": False})
    return model, optimizer, tools


def step(tools, model, optimizer, n, losses=None, calls=None):
    """One optimizer step through the tools, as an integration drives them; its loss is appended to
    ``losses`` and the name of each call to the tools, before it runs, to ``calls`` when given."""
    calls = [] if calls is None else calls
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(n))
    calls.append("begin_step")
    tools.begin_step(n)
    tools.before_forward(x)
    loss = model(x).pow(2).mean()
    if losses is not None:
        losses.append(float(loss.detach()))
    tools.after_forward(loss)
    calls.append("before_last_backward")
    tools.before_last_backward()
    loss.backward()
    calls.append("grads_final")
    tools.grads_final(optimizer)
    optimizer.step()
    optimizer.zero_grad()
    calls.append("end_step")
    tools.end_step()


def run(tools, model, optimizer, steps, losses=None, calls=None):
    done = []
    try:
        for n in range(steps):
            step(tools, model, optimizer, n, losses, calls)
            done.append(n)
    except NonFiniteStepError as e:
        return done, e
    return done, None


@pytest.mark.parametrize("nancapture", [True, False])
def test_several_processes_stop_a_step_later_naming_the_step(tmp_path, nancapture):
    """Adam's exp_avg_sq gets an Inf in step 2's optimizer step. One process stops in step 2's end_step;
    with several the verdict is agreed a step later: nancapture's read in step 3's grads_final, or
    the asynchronous agreement read in step 3's end_step. The error names step 2 either way."""
    model, optimizer, tools = make(tmp_path, nancapture=nancapture)
    losses, calls = [], []
    done, err = run(tools, model, optimizer, 6, losses, calls)
    assert err is not None and tools.closed
    assert done == [0, 1, 2]  # step 2 ends; step 3 stops
    assert calls[-1] == ("grads_final" if nancapture else "end_step")
    assert (err.step, err.stopped_at, err.origin) == (2, 3, "optimizer_step")
    assert err.state_entries == ["0.weight: exp_avg_sq"] and not err.other_rank
    head = "The optimizer step of step 2 (rank 0 of 2) wrote non-finite values "
    if nancapture:  # nancapture checked the step's loss and gradients: the guard says what they were
        assert str(err).startswith(head + f"from finite gradients (loss {losses[2]:.4g}, gradient norm ")
        assert err.failure.loss == pytest.approx(losses[2], rel=1e-6) and 0 < err.failure.gradient_norm < 10
    else:
        assert str(err).startswith(head + "(its loss and gradients were not checked).")
    assert "\nNext: fix the optimizer step" in str(err)


@pytest.mark.parametrize("nancapture", [True, False])
def test_underflow_overflows_decision_carries_the_verdict_first(tmp_path, nancapture):
    """With underflow_overflow on, its forward decision (before the last backward) is the next step's
    first collective read: the guard's verdict rides on it, so no tool reports a consequence of the
    failed optimizer step before the guard names it."""
    model, optimizer, tools = make(tmp_path, nancapture=nancapture, underflow_overflow=True)
    calls = []
    done, err = run(tools, model, optimizer, 6, calls=calls)
    assert done == [0, 1, 2] and calls[-1] == "before_last_backward"
    assert (err.step, err.stopped_at, err.state_entries) == (2, 3, ["0.weight: exp_avg_sq"])


@pytest.mark.parametrize("underflow_overflow", [False, True])
def test_one_process_whose_verdict_had_not_landed_stops_at_the_next_read(tmp_path, underflow_overflow):
    """One process on a GPU: end_step looks without waiting and may find no verdict yet (simulated).
    The next step's read (nancapture's, or underflow_overflow's first) carries it, so the guard names
    step 2 before a tool reports what followed from it."""
    model, optimizer, tools = make(tmp_path, world_size=1, underflow_overflow=underflow_overflow)
    tools.update_guard.visible = lambda: None  # the copy to the host never lands in time
    calls = []
    done, err = run(tools, model, optimizer, 6, calls=calls)
    assert done == [0, 1, 2] and calls[-1] == ("before_last_backward" if underflow_overflow else "grads_final")
    assert (err.step, err.stopped_at, err.state_entries) == (2, 3, ["0.weight: exp_avg_sq"])
    assert str(err).startswith("The optimizer step of step 2 (rank 0 of 1) wrote non-finite values")


@pytest.mark.parametrize("nancapture, underflow_overflow", [(True, False), (False, False), (False, True)])
def test_a_failure_in_step_0_is_agreed_at_step_1(tmp_path, nancapture, underflow_overflow):
    """The verdict's step 0 is a failure too (a failed step is recorded as its number, >= 0), on every
    path the agreement takes."""
    model, optimizer, tools = make(tmp_path, nancapture=nancapture, plant_at=0, underflow_overflow=underflow_overflow)
    done, err = run(tools, model, optimizer, 4)
    assert done == [0] and (err.step, err.stopped_at, err.state_entries) == (0, 1, ["0.weight: exp_avg_sq"])


@pytest.mark.parametrize("nancapture", [True, False])
def test_a_state_loaded_with_an_inf_is_told_as_such_when_the_ranks_agree(tmp_path, nancapture):
    """An AdamW state that holds an Inf before step 0 (loaded so): agreed a step later, the message still
    says it was out of range before the first step checked, with the advice about what the run started
    from, not "fix the optimizer step"."""
    model, optimizer, tools = make(tmp_path, nancapture=nancapture, plant_at=99)
    x = torch.randn(8, 4)
    model(x).pow(2).mean().backward()
    optimizer.step()  # the state a checkpoint would hold; then an Inf in it
    optimizer.zero_grad()
    optimizer.state[model[0].weight]["exp_avg_sq"].view(-1)[0] = float("inf")
    done, err = run(tools, model, optimizer, 4)
    assert done == [0] and (err.step, err.stopped_at, err.failure.before) == (0, 1, "already")
    assert str(err).startswith("Before the optimizer step of step 0 (rank 0 of 2), the first this guard checked, the "
                               "weights or the optimizer state already held non-finite values.")
    assert str(err).endswith("\nNext: check the weights and optimizer state the run started from (initialisation, "
                             "or the checkpoint loaded): they were out of range before the first optimizer step.")


def test_one_process_stops_in_the_failing_steps_end_step(tmp_path):
    model, optimizer, tools = make(tmp_path, world_size=1)
    done, err = run(tools, model, optimizer, 6)
    assert done == [0, 1] and (err.step, err.stopped_at) == (2, 2)


@pytest.mark.parametrize("world_size, nancapture", [(2, True), (2, False), (1, True)])
def test_finish_reads_the_last_steps_verdict(tmp_path, world_size, nancapture):
    """The last step's check has no later step to ride on: finish() reads it (one process: with a
    wait, for a GPU whose copy of the verdict had not landed at end_step; simulated here)."""
    model, optimizer, tools = make(tmp_path, world_size=world_size, nancapture=nancapture, plant_at=3)
    looked = []
    for n in range(4):
        if world_size == 1 and n == 3:
            tools.update_guard.visible = lambda: looked.append(3)  # the copy has not landed: None
        step(tools, model, optimizer, n)
    assert looked == ([3] if world_size == 1 else []), "end_step looked without waiting"
    assert not tools.closed
    with pytest.raises(NonFiniteStepError) as info:
        tools.finish()
    assert (info.value.step, info.value.stopped_at) == (3, 3) and tools.closed
    tools.finish()  # after the stop: nothing


def test_finish_after_a_clean_run_says_nothing(tmp_path):
    model, optimizer, tools = make(tmp_path, nancapture=False, plant_at=99)
    for n in range(3):
        step(tools, model, optimizer, n)
    tools.finish()
    assert not tools.closed


@pytest.mark.parametrize("nancapture", [True, False])
def test_the_agreement_adds_no_host_read_per_step(tmp_path, nancapture):
    """Each clean step reads the host as often with the guard agreed over 2 ranks as in one process
    (CPU AdamW's own reads included): nancapture's read carries the verdict, and with it off the
    agreement's read is of host memory a step later."""
    counts = {}
    for world_size in (1, 2):
        model, optimizer, tools = make(tmp_path / str(world_size), world_size=world_size, nancapture=nancapture,
                                       plant_at=99)
        step(tools, model, optimizer, 0)  # arms the guard and checks what it started from
        with CountSyncs() as syncs:
            for n in range(1, 4):
                step(tools, model, optimizer, n)
        counts[world_size] = syncs.count
    assert counts[2] == counts[1] > 0


def test_a_lagged_agreement_is_read_once_and_in_order():
    agreement = LaggedAgreement()
    assert not agreement.pending and agreement.result() is False
    agreement.start(torch.tensor(True))
    with pytest.raises(RuntimeError, match=r"^LaggedAgreement\.start: the previous flag was not read$"):
        agreement.start(torch.tensor(False))
    assert agreement.pending and agreement.result() is True and not agreement.pending
    agreement.start(torch.tensor(False))
    assert agreement.result() is False


def test_what_the_signals_cannot_measure_is_said_once_by_rank_0(tmp_path, caplog):
    """A model without attention or output logits: the mechanism signals say so, once, from rank 0 only
    (every rank finds the same; rank 1 of 2 is silent)."""
    logged = {}
    for rank in (0, 1):
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        optimizer = torch.optim.AdamW(model.parameters())
        tools = StepTools(model, framework="accelerate", out_dir=tmp_path / str(rank), rank=rank, world_size=2,
                          optimizer=optimizer, trend_alerts={"enabled": False})
        caplog.clear()
        with caplog.at_level("WARNING", logger="stabletrain"):
            for n in range(3):
                tools.begin_step(n, log_signals=True)
                x = torch.randn(8, 4)
                tools.before_forward(x)
                loss = model(x).pow(2).mean()
                tools.after_forward(loss)
                tools.before_last_backward()
                loss.backward()
                tools.grads_final(optimizer)
                optimizer.step()
                optimizer.zero_grad()
                assert "signals/update_rms_max" in tools.read_signals()
                tools.end_step()
        logged[rank] = [r.getMessage() for r in caplog.records]
        tools.close()
    assert logged[1] == []
    assert logged[0] == [
        "stabletrain signals: no attention found in Sequential (no scaled_dot_product_attention call, and no softmax "
        "over the last dimension inside an attention module, in the forward pass): signals/attn_* not measured.",
        "stabletrain signals: no output logits found in Sequential (no cross_entropy or log_softmax call outside "
        "attention in the forward pass): signals/output_* not measured.",
    ]
