"""Attribution on hand-built records: which row is blamed, and on whom, for each rule of
docs/underflow_overflow.md (Who is blamed), without running a model."""

from __future__ import annotations

import torch
from uo_builders import INF, NAN, calls, fwd, grad, row

from stabletrain.debug.underflow_overflow.attribution import (
    Culprit,
    blame,
    explain,
    find_culprit,
    first_nonfinite_shown,
    sample_rows,
)
from stabletrain.debug.underflow_overflow.records import Event, Role, host_values


def culprit_of(events: list[Event], start: int = 0):
    return find_culprit(events, host_values(events), start)


def masked_inf_events(b_out: float) -> list[Event]:
    """``a`` returns Inf, ``b`` takes it and returns ``b_out``, and so does the model."""
    c = calls()
    return [
        fwd("enter", c[""], row("input[0]", "input", 0.1, 1.0, "x", data=False)),
        fwd("enter", c["a"], row("input[0]", "input", 0.1, 1.0, "x")),
        fwd("exit", c["a"], row("output[0]", "output", 0.0, INF, "h")),
        fwd("enter", c["b"], row("input[0]", "input", 0.0, INF, "h")),
        fwd("exit", c["b"], row("output[0]", "output", 0.0, b_out, "y")),
        fwd("exit", c[""], row("output[0]", "output", 0.0, b_out, "y")),
    ]


def test_a_nonfinite_value_that_a_later_module_neutralised_is_harmless():
    events = masked_inf_events(b_out=1.0)
    assert culprit_of(events) is None
    assert first_nonfinite_shown(events, host_values(events)) == (2, 0), "a trace still names a's Inf output"
    # The loss goes non-finite later: that is the harm, and the neutralised Inf is not blamed.
    events.append(fwd("loss", calls()[""], row("loss", "loss", NAN, NAN)))
    assert culprit_of(events) == Culprit(6, 0)
    assert blame(events[6], 0, "Net").explanation == "The model's outputs were finite; the loss computed from them is not."


def test_an_output_that_reaches_the_model_output_is_blamed_on_the_module_that_made_it():
    events = masked_inf_events(b_out=INF)
    assert culprit_of(events) == Culprit(2, 0)
    assert blame(events[2], 0, "Net") == (
        "a", "Lin", "output[0]", "The inputs and weights of this call were finite, its output is not.")


def test_a_nan_passed_on_is_blamed_where_it_was_first_seen_the_callers_own_ops():
    c = calls()
    events = [
        fwd("enter", c[""], row("input[0]", "input", 0.1, 1.0, "x", data=False)),
        fwd("enter", c["a"], row("weight", "weight", 0.1, 1.0), row("input[0]", "input", NAN, NAN, "n")),
        fwd("exit", c["a"], row("output[0]", "output", NAN, NAN, "m")),
        fwd("exit", c[""], row("output[0]", "output", NAN, NAN, "m")),
    ]
    found = culprit_of(events)
    assert found == Culprit(1, 1), "a's input, not its output: a only passed the NaN on"
    assert explain(events, found, "Net") == (
        "", "Net", "a input[0]",
        "No module returned it: an operation in the own forward of the model itself (Net), between its child "
        "modules, made the input[0] of a.",
    )


def test_a_nan_made_from_an_inf_input_is_the_calls_own_a_fully_masked_softmax():
    c = calls()
    events = [
        fwd("enter", c[""], row("input[0]", "input", 0.1, 1.0, "x", data=False),
            row("input[1]", "input", 0.0, INF, "mask", data=False)),
        fwd("enter", c["b"], row("input[0]", "input", 0.1, 1.0, "x"), row("input[1]", "input", 0.0, INF, "mask")),
        fwd("exit", c["b"], row("output[0]", "output", NAN, NAN, "y")),
        fwd("exit", c[""], row("output[0]", "output", NAN, NAN, "y")),
    ]
    found = culprit_of(events)
    assert found == Culprit(2, 0, "input[1]")
    culprit = explain(events, found, "Net")
    assert (culprit.module, culprit.tensor) == ("b", "output[0]")
    assert culprit.explanation.startswith("Its input[1] held Inf (an attention mask, say) and its inputs held no NaN")
    assert blame(events[2], 0, "Net").explanation != culprit.explanation, "plain blame does not know the Inf input"


def inf_between_children_events(consumer_cls: str, made: torch.Tensor) -> tuple[list[Event], dict]:
    """The model's own forward makes ``made`` (holding Inf) between its children and hands it
    to ``b`` (of class ``consumer_cls``), which returns NaN, and so does the model."""
    c = calls()
    c["b"].cls = consumer_cls
    events = [
        fwd("enter", c[""], row("input[0]", "input", 0.1, 1.0, "x", data=False)),
        fwd("enter", c["a"], row("input[0]", "input", 0.1, 1.0, "x")),
        fwd("exit", c["a"], row("output[0]", "output", 0.1, 1.0, "h")),
        fwd("enter", c["b"], row("input[0]", "input", 0.0, INF, tensor=made)),
        fwd("exit", c["b"], row("output[0]", "output", NAN, NAN, "y")),
        fwd("exit", c[""], row("output[0]", "output", NAN, NAN, "y")),
    ]
    return events, c


def test_an_inf_the_caller_made_between_children_is_the_callers_not_the_next_modules():
    # h = self.a(x); h = h / torch.zeros_like(h); return self.b(h): b (a Linear) made NaN from
    # an Inf that no module returned; the op that made the Inf is the caller's own.
    made = torch.full((5, 4), INF)
    made[0] = -INF
    events, _ = inf_between_children_events("Linear", made)
    found = culprit_of(events)
    assert found == Culprit(3, 0), "b's input, where the Inf was first seen"
    assert explain(events, found, "Net") == (
        "", "Net", "b input[0]",
        "No module returned it: an operation in the own forward of the model itself (Net), between its child "
        "modules, made the input[0] of b.",
    )
    # The same tensor reaching a softmax: +inf is no attention mask either.
    assert culprit_of(inf_between_children_events("Softmax", made)[0]) == Culprit(3, 0)


def test_an_additive_mask_the_caller_made_reaching_a_softmax_or_attention_is_still_tolerated():
    mask = torch.zeros(5, 4)
    mask[2] = -INF  # a row masked everywhere
    for cls in ("Softmax", "MultiheadAttention", "LlamaAttention", "CausalSelfAttention"):
        events, _ = inf_between_children_events(cls, mask)
        found = culprit_of(events)
        assert found == Culprit(4, 0, "input[0]"), cls
        assert explain(events, found, "Net").explanation.startswith("Its input[0] held Inf (an attention mask, say)")
    # A Linear given the same -inf is not taking a mask: the caller made it.
    assert culprit_of(inf_between_children_events("Linear", mask)[0]) == Culprit(3, 0)


def test_non_finite_data_is_blamed_unless_it_is_a_mask():
    c = calls()
    data = [fwd("enter", c[""], row("input[0]", "input", 0.0, INF, "x", data=True))]
    assert culprit_of(data) == Culprit(0, 0)
    assert blame(data[0], 0, "Net") == (
        "", "Net", "input[0]", "The input given to the model is non-finite: check the batch.")
    mask = [fwd("enter", c[""], row("input[0]", "input", 0.0, INF, "x", data=False))]
    assert culprit_of(mask) is None


def test_weights_and_weight_gradients_are_blamed_on_their_module_and_rows_before_start_are_not():
    c = calls()
    events = [
        fwd("enter", c["a"], row("weight", "weight", NAN, NAN)),
        fwd("enter", c["b"], row("weight", "weight", 0.5, INF)),
        Event("backward", 0, 0, "param", c["a"], [row("grad of bias", "grad", NAN, NAN)]),
    ]
    assert culprit_of(events) == Culprit(0, 0)
    assert blame(events[0], 0, "Net") == ("a", "Lin", "weight", "A weight of this module is non-finite.")
    assert culprit_of(events, start=1) == Culprit(1, 0), "history before start is context, not a culprit"
    assert blame(events[2], 0, "Net") == (
        "a", "Lin", "grad of bias", "The backward of this module made the gradient of its bias non-finite.")


def test_a_gradient_is_blamed_on_the_innermost_consumer_else_on_the_producers_parent():
    c = calls()
    consumed = grad([Role(c["a"], "input", "input[0]"), Role(c["a.inner"], "input", "input[0]"),
                     Role(c["b"], "output", "output[0]")], NAN, NAN)
    assert blame(consumed, 0, "Net")[:3] == ("a.inner", "Act", "grad of input[0]"), "the deepest consumer"

    produced = grad([Role(c["a"], "output", "output[0]"), Role(c["a.inner"], "output", "output[0]")], NAN, NAN)
    module, cls, tensor, why = blame(produced, 0, "Net")
    # The outermost producer's parent used it; the tensor is named by the innermost producer.
    assert (module, cls, tensor) == ("", "Net", "grad of a.inner output[0]")
    assert why.startswith("No module took a.inner output[0] as input: the backward of an operation in the own "
                          "forward of the model itself (Net)")

    returned = grad([Role(c[""], "output", "output[0]")], INF, INF)
    assert blame(returned, 0, "Net")[:3] == ("", "Net", "grad of output[0]")


def test_sample_rows_come_from_the_tensor_if_still_held_unchanged_else_from_a_later_one():
    c = calls()
    held = torch.zeros(5, 4)
    held[1, 2] = NAN
    held[3] = INF
    events = [fwd("exit", c["a"], row("output[0]", "output", 0.0, NAN, tensor=held))]
    assert sample_rows(events, host_values(events), 0, 0) == [1, 3]

    later = torch.zeros(5, 4)
    later[4, 0] = NAN
    events.append(fwd("exit", c["b"], row("output[0]", "output", 0.0, NAN, tensor=later)))
    held.add_(1)  # changed in place after it was recorded: its rows no longer say anything
    assert sample_rows(events, host_values(events), 0, 0) == [4]

    c[""].batch = None
    for call in c.values():
        call.batch = None
    assert sample_rows(events, host_values(events), 0, 0) is None, "batch size unknown"
