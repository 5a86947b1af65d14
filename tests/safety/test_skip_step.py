"""SkipStep on its own: a skipped step leaves parameters and optimizer state bitwise as they were,
also after the optimizer's state tensors were replaced (a rollback loads a snapshot into the
optimizer, then training and skipping go on); what the saved copy costs."""

from __future__ import annotations

import copy

import torch

from stabletrain.safety.skip_step import SkipStep, optimizer_tensors


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _backward(model):
    model(torch.randn(4, 3)).pow(2).sum().backward()


def _values(opt):
    return [t.detach().clone() for t in optimizer_tensors(opt)]


def test_saved_bytes_is_the_parameters_and_their_floating_state():
    model, opt = _setup()
    skipper = SkipStep(opt)
    assert skipper.saved_bytes == 0
    _backward(model)
    opt.step()
    skipper.save()
    params = sum(p.numel() for p in model.parameters())
    assert skipper.saved_bytes == 3 * params * 4, "weights, exp_avg, exp_avg_sq in float32 (not the 0-dim step)"


def test_a_skip_after_the_optimizer_state_was_replaced_restores_the_new_state():
    model, opt = _setup()
    skipper = SkipStep(opt)
    for _ in range(2):
        _backward(model)
        skipper.save()
        opt.step()
        skipper.apply(torch.tensor(False))
        opt.zero_grad()
    # A rollback: the optimizer gets a snapshot's state (new tensors, as many as before).
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    before = _values(opt)
    _backward(model)
    skipper.save()
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, _values(opt)))
    skipper.apply(torch.tensor(True))
    assert all(torch.equal(a, b) for a, b in zip(before, _values(opt))), "skipped: bitwise as before the step"
