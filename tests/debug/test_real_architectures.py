"""The accuracy table: underflow_overflow and diagnose on real architectures (Hugging Face
transformers, torch.nn attention, torchvision) with faults planted at known places, and
legitimate -inf attention masks that must never be blamed. See real_models.py and docs/accuracy.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diagnosis_checks import assert_consistent
from real_models import CASES, EXPECTED, render_markdown, run_diagnose, run_underflow_overflow

pytest.importorskip("transformers")
pytest.importorskip("torchvision")


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models: threads cost more than they give, and the machine is shared.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("arch, fault", CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_underflow_overflow(arch, fault, tmp_path):
    assert run_underflow_overflow(arch, fault, tmp_path) == EXPECTED[(arch, fault)][0]


@pytest.mark.parametrize("arch, fault", CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_diagnose(arch, fault, tmp_path):
    cell, d = run_diagnose(arch, fault, tmp_path)
    assert cell == EXPECTED[(arch, fault)][1]
    if d is None:
        return
    data = assert_consistent(d)
    f = d.finding
    if fault == "all_padding":
        # Both origins are named: the softmax that made the NaN and the mask that wrote the -inf.
        assert f.origin == "inf" and f.cause.written and f.cause.kind == "-Inf" and f.cause.op_name == "masked_fill_"
        assert "NaN born in _softmax in pool (MultiheadAttention), forward, from -Inf written by masked_fill_ in pool" \
            in d.to_markdown()
        assert "on the sample at dataset index 22" in d.probable_cause and "masked everywhere" in d.probable_cause
        assert "unmasked position in every row" in d.next_actions[0] and "dataset index 22" in d.next_actions[0]
    if fault == "mlp_overflow":
        # Born in the projection from finite inputs (an Inf, or a NaN where +Inf and -Inf met in one sum).
        assert data["data"]["status"] == "not_data_specific" and f.origin == "op" and not f.inputs_nonfinite
        assert f.output.nan + f.output.posinf + f.output.neginf > 0 and d.weights.status == "huge"
    if fault == "nan_input":
        assert f.inputs_nonfinite and f.origin == "data" and d.origin == "data" and f.rows == [2]
        assert "embeds" in f.input_name or "image" in f.input_name or "x" in f.input_name


def test_accuracy_page_is_the_table_the_tests_assert():
    page = Path(__file__).resolve().parents[2] / "docs" / "accuracy.md"
    assert page.read_text() == render_markdown(), "run: python tests/debug/real_models.py"
