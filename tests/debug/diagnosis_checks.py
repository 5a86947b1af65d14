"""What every diagnosis must hold: its JSON fields agree with each other and with the Markdown."""

from __future__ import annotations

import json
import re
from typing import Any

from stabletrain.debug.diagnose import NOT_REPRODUCIBLE, PRECISION_INDUCED, Diagnosis

_REDUCED = {"16-mixed", "bf16-mixed", "16-true", "bf16-true"}


def section(report: str, title: str) -> str:
    """The Markdown between ``## title`` and the next heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", report, re.S | re.M)
    assert match, f"no section {title!r} in the report"
    return match.group(1)


def assert_consistent(d: Diagnosis) -> dict[str, Any]:
    """Check a diagnosis against itself; returns its JSON (as written to diagnosis.json)."""
    data = json.loads(json.dumps(d.to_dict()))
    report = d.to_markdown()

    # Next actions: numbered 1..n, in the order and words of the JSON.
    items = [line for line in section(report, "Next actions").splitlines() if line.strip()]
    numbered = [re.match(r"^(\d+)\. (.*)$", line) for line in items if not line.startswith("Diagnosed in ")]
    assert all(numbered), f"a Next actions line is not a numbered item: {items}"
    assert [int(m.group(1)) for m in numbered] == list(range(1, len(data["next_actions"]) + 1))
    assert [m.group(2) for m in numbered] == data["next_actions"] and all(a.strip() for a in data["next_actions"])
    assert not any("\n" in a for a in data["next_actions"]), "an action spans lines: the list would break"

    assert f"**Verdict: {d.cause_title}** — {d.probable_cause}." in report
    assert data["verdict"] == f"{d.cause_title}: {d.probable_cause}"

    # The cause follows from the replays.
    captured = [r for r in data["replays"][:2]]
    both = all(r["reproduced"] for r in captured)
    assert (data["cause"] == NOT_REPRODUCIBLE) == (not both)
    if both:
        reduced_and_fp32_finite = data["precision"] in _REDUCED and not data["reproduces_in"].get("32-true", False)
        assert (data["cause"] == PRECISION_INDUCED) == reduced_and_fp32_finite

    # Which data: culprits only when isolated; examples only when not data-specific.
    dd, which = data["data"], section(report, "Which data")
    if dd["status"] == "isolated":
        assert dd["rows"] and dd["row_sets"] and dd["rows"] == dd["row_sets"][0] and not dd["examples"]
        for i in dd["dataset_indices"] or []:
            assert str(i) in which, f"dataset index {i} is not in the Which data section"
    else:
        assert dd["rows"] == [] and dd["row_sets"] == [] and dd["dataset_indices"] is None and not dd["index_sets"]
        assert "dataset index" not in d.probable_cause, "a failure that does not depend on data names no sample"
    if dd["status"] == "not_data_specific":
        assert dd["examples"] and "does not depend on particular data" in which
        if data["traced_on"] and data["traced_on"]["rows"]:
            assert data["traced_on"]["rows"] == dd["examples"][0]
    elif dd["status"] == "isolated" and data["traced_on"] and data["traced_on"]["rows"]:
        assert data["traced_on"]["rows"] == dd["rows"]

    # Where: the op, module and phase of the JSON are the ones the Markdown shows.
    where = data["where"]
    if where is not None:
        text = section(report, "Where")
        assert f"`{where['op']}`" in text and where["where"] in text and f"{where['phase']} pass" in text
        assert where["chain"], "every finding says where its value came from"
        if where["origin"] == "inf":
            assert where["cause"] is not None and "- origin: " in text
        assert (data["origin"] is not None) <= where["inputs_nonfinite"]
    return data
