"""The log's frames, sections and file, and the errors' messages, on hand-built records: the exact
text a user reads (docs/underflow_overflow.md shows it), without running a model."""

from __future__ import annotations

from pathlib import Path

from uo_builders import INF, NAN, calls, fwd, grad, row

from stabletrain.debug.underflow_overflow import UnderflowOverflowAbort, UnderflowOverflowError, log_path
from stabletrain.debug.underflow_overflow.attribution import Blame
from stabletrain.debug.underflow_overflow.errors import NEXT_STEPS
from stabletrain.debug.underflow_overflow.records import Event, Role, host_values
from stabletrain.debug.underflow_overflow.render import (
    LogFile,
    failure_section,
    frame_lines,
    group_frames,
    log_header,
    other_rank_section,
    trace_section,
)

TABLE_HEAD = "      abs min     abs max  tensor"


def step_events() -> list[Event]:
    """One step: the model's inputs, a's call, the loss (microbatch 1), then a's backward."""
    c = calls()
    return [
        fwd("enter", c[""], row("input[0]", "input", 0.5, 2.0, "x")),
        fwd("enter", c["a"], row("weight", "weight", 0.25, 3.0, shape=(4, 4)), row("input[0]", "input", 0.5, 2.0)),
        fwd("exit", c["a"], row("output[0]", "output", 0.0, 1e38)),
        fwd("exit", c[""], row("output['y']", "output", 0.0, 1e38)),
        fwd("loss", c[""], row("loss", "loss", 4.0, 4.0, shape=()), micro=1),
        grad([Role(c["a"], "output", "output[0]"), Role(c[""], "output", "output['y']")], 1.0, 1.0),
        grad([Role(c["a"], "input", "input[0]"), Role(c[""], "input", "input[0]"), Role(c["b"], "input", "input[0]"),
              Role(c["b"], "output", "output[0]")], NAN, NAN),
    ]


def test_frames_merge_a_calls_inputs_and_outputs_and_a_modules_gradients():
    events = step_events()
    frames = group_frames(events)
    assert [(f.phase, f.module, f.suffix, len(f.rows)) for f in frames] == [
        ("forward", "", "inputs", 1),
        ("forward", "a", "", 3),  # its inputs, then its outputs: one frame
        ("forward", "", "outputs", 1),  # the model's inputs are far before: a frame of its own
        ("forward", "", "training_step", 1),
        ("backward", "a", "", 2),
    ]
    assert frame_lines(frames, host_values(events), (6, 0)) == [
        TABLE_HEAD,
        "[forward] step 0  <model> (Net) inputs",
        "    5.000e-01   2.000e+00  input[0]                 float32[5, 4]",
        "[forward] step 0  a (Lin)",
        "    2.500e-01   3.000e+00  weight                   float32[4, 4]",
        "    5.000e-01   2.000e+00  input[0]                 float32[5, 4]",
        "    0.000e+00   1.000e+38  output[0]                float32[5, 4]",
        "[forward] step 0  <model> (Net) outputs",
        "    0.000e+00   1.000e+38  output['y']              float32[5, 4]",
        "[forward] step 0.1  <model> (Net) training_step",
        "    4.000e+00   4.000e+00  loss                     float32[]",
        "[backward] step 0  a (Lin)",
        "    1.000e+00   1.000e+00  grad of output[0] (= <model> output['y']) float32[5, 4]",
        "          nan         nan  grad of input[0] (= <model> input[0], b input[0], ...) float32[5, 4]"
        "   <-- first non-finite (nan)",
    ]


def test_a_failure_whose_culprit_is_a_modules_own_ops_keeps_the_frame_it_was_seen_in():
    c = calls()
    events = [
        fwd("enter", c["a"], row("input[0]", "input", 0.5, 2.0)),
        fwd("exit", c["a"], row("output[0]", "output", 0.5, 2.0)),
        fwd("enter", c["b"], row("input[0]", "input", 0.5, 2.0), row("input[1]", "input", NAN, NAN),
            row("input[2]", "input", INF, INF)),
    ]
    why = "No module returned it: an operation in the own forward of the model itself (Net), ..."
    culprit = Blame("", "Net", "b input[1]", why)
    text = failure_section(events, host_values(events), (2, 1), culprit, "nan", max_frames=1)
    assert text.splitlines() == [
        "=== step 0, forward: non-finite value (nan) ===",
        "culprit: the model itself (Net)",
        "tensor:  b input[1]",
        f"why:     {why}",
        "frames:  the last 2 in execution order, the culprit last",
        "",
        TABLE_HEAD,
        "[forward] step 0  b (Soft) inputs",
        "    5.000e-01   2.000e+00  input[0]                 float32[5, 4]",
        "          nan         nan  input[1]                 float32[5, 4]   <-- first non-finite (nan)",
        "[forward] step 0  <model> (Net) own ops  <-- culprit",
        f"  b input[1]: {why}",
    ], "input[2], after the bad row, is not part of the story"
    plain = failure_section(events, host_values(events), (2, 1), culprit._replace(module="b", explanation=""),
                            "nan", max_frames=2)
    assert "why:     it is the first non-finite value in execution order" in plain and "own ops" not in plain
    assert "frames:  the last 2 in execution order" in plain and "[forward] step 0  a (Lin)" in plain


def test_trace_and_other_rank_sections_say_what_was_seen():
    events = step_events()[:5]
    values = host_values(events)
    seen = Blame("a", "Lin", "output[0]", "")
    harmless = trace_section(7, events, values, (2, 0), seen, harmful=False).splitlines()
    assert harmless[:2] == [
        "=== step 7: trace (trace_batch_nums), every frame, 4 frames ===",
        "non-finite values seen in this step; the first: module a (Lin), output[0] (forward). Not aborting: the "
        "step is traced. It did no harm: the model's outputs, the loss and the gradients stayed finite.",
    ]
    assert harmless[2] == TABLE_HEAD and len(harmless) == 3 + 4 + 6, "every frame and row of the step"
    harmful = trace_section(7, events, values, (2, 0), seen, harmful=True)
    assert "traced. It did no harm" not in harmful and "Not aborting: the step is traced.\n" in harmful
    assert trace_section(7, events, values, None, None, harmful=False).splitlines()[1] == TABLE_HEAD

    other = other_rank_section(3, 0, events, values, [1, 2], "backward", max_frames=2).splitlines()
    assert other[:3] == [
        "=== step 3: rank 1, 2 found a non-finite value (backward); none on this rank (rank 0) ===",
        "see underflow_overflow_rank1.log for the culprit; this rank's last 2 frames follow",
        "",
    ]
    assert other[4] == "[forward] step 0  <model> (Net) outputs" and len(other) == 4 + 4


def test_the_log_file_has_one_header_and_every_section_in_order(tmp_path):
    path = log_path(tmp_path / "debug", 3)
    assert path == tmp_path / "debug" / "underflow_overflow_rank3.log"
    header = log_header(3, "Net", 4, include_backward=False)
    assert header.splitlines()[:2] == [
        "stabletrain underflow/overflow report, rank 3", "model: Net, 4 modules watched, backward not included"]
    log = LogFile(path, header)
    assert not log.written and not path.exists()
    assert log.append("=== one ===\n") == path
    assert log.append("=== two ===\n") == path and log.written
    assert path.read_text() == header + "=== one ===\n\n=== two ===\n\n"
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temporary file left behind"


def test_error_messages_name_the_culprit_the_samples_and_the_log(tmp_path):
    log = tmp_path / "underflow_overflow_rank0.log"
    err = UnderflowOverflowError(step=4, rank=0, detected_by=[0], log_path=log, phase="backward", module="a",
                                 module_type="Lin", tensor="grad of input[0]", value="nan", explanation="Why.",
                                 rows=[1, 3])
    assert str(err) == (
        "step 4, rank 0, backward: the first non-finite value (nan) is in module a (Lin), tensor grad of input[0]. "
        f"Why. Samples (rows of the batch) holding it: [1, 3]. The last frames, culprit last: {log}\n{NEXT_STEPS}"
    )
    assert NEXT_STEPS.startswith("Next: read the report") and "stabletrain diagnose" in NEXT_STEPS
    model = UnderflowOverflowError(step=4, rank=0, detected_by=[0], log_path=log, phase="forward", module="",
                                   module_type="Net", tensor="loss", value="inf", explanation="Why.")
    assert "is in the model itself (Net), tensor loss. Why. The last frames" in str(model)
    bystander = UnderflowOverflowError(step=4, rank=2, detected_by=[0, 1], log_path=log, phase="forward")
    assert str(bystander) == (
        "step 4: rank 0, 1 found a non-finite value in the forward pass (see underflow_overflow_rank0.log beside "
        f"this rank's report); rank 2 found none and stopped with it. This rank's last frames: {log}\n{NEXT_STEPS}"
    )
    assert bystander.module is None and bystander.report_path == Path(log)
    assert str(UnderflowOverflowAbort(2, log)) == (
        f"abort_after_batch_num=2: stopped after step 2 as asked; traced steps are in {log}")
