"""The docs stay true: links resolve, every example output has its generator, the cheap
examples still print what the docs show, and the documented plain-loop programs run."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from conftest import cli_env

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
_spec = importlib.util.spec_from_file_location("gen_examples", DOCS / "gen_examples.py")
gen_examples = sys.modules["gen_examples"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_examples)  # docs/ is not a package

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _prose(text: str) -> str:
    """The Markdown without fenced blocks and inline code, where links are not links."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def _heading_text(line: str) -> str:
    text = line.lstrip("#").strip()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # [label](target) -> label
    return text.replace("`", "").replace("*", "")


def _mkdocs_slug(text: str) -> str:
    """Python-Markdown's toc slugify, which mkdocs uses."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _github_slug(text: str) -> str:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def _anchors(page: Path) -> tuple[set[str], set[str]]:
    text = FENCE.sub("", page.read_text())
    headings = [_heading_text(line) for line in text.splitlines() if re.match(r"#{1,6} ", line)]
    return {_mkdocs_slug(h) for h in headings}, {_github_slug(h) for h in headings}


def test_every_relative_link_in_readme_and_docs_points_to_a_file_and_anchor_that_exist():
    broken, checked = [], 0
    for page in _pages():
        for target in LINK.findall(_prose(page.read_text())):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            checked += 1
            if not dest.exists():
                broken.append(f"{where}: no file {dest}")
            elif page.is_relative_to(DOCS) and not dest.is_relative_to(DOCS):
                broken.append(f"{where}: leaves docs/, which the site does not hold")
            elif anchor:
                mkdocs, github = _anchors(dest) if dest.suffix == ".md" else (set(), set())
                if anchor not in mkdocs or anchor not in github:
                    broken.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
    assert checked > 50, "the link pattern finds the links"
    assert not broken, "\n".join(broken)


def test_the_link_checker_sees_a_broken_link_and_anchor(tmp_path):
    assert _mkdocs_slug("Dissecting a step: forward_backward") == "dissecting-a-step-forward_backward"
    tour = "a-tour-train-blow-up-replay-diagnose-resume"
    assert _github_slug("A tour: train, blow up, replay, diagnose, resume") == tour
    page = tmp_path / "p.md"
    page.write_text("# Title\n\n[a](p.md#title) [b](p.md#nope) `[c](nowhere.md)`\n```\n[d](nowhere.md)\n```\n")
    links = LINK.findall(_prose(page.read_text()))
    assert links == ["p.md#title", "p.md#nope"]
    assert _anchors(page)[0] == {"title"}


def test_every_example_output_has_a_generator_and_every_generator_a_place():
    assert gen_examples.marker_problems(gen_examples.read_pages()) == []


def test_a_hand_written_output_block_is_caught():
    """Output must come from the command beside it: a console/json/text block outside gen markers is a
    problem, unless the line before says it is no program's output."""
    page = ROOT / "docs" / "x.md"
    text = ("# X\n\n```console\n$ stabletrain train out=o\nDone: 1 steps\n```\n\n"
            "<!-- gen:tour-train -->\n```console\n$ generated\n```\n<!-- /gen:tour-train -->\n\n"
            "<!-- not-output: a tree drawn by hand -->\n```\nsrc/\n  a.py\n```\n\n"
            "```text\nNonFiniteStepError: ...\n```\n\n```json\n{\"step\": 0}\n```\n\n```python\nprint(1)\n```\n")
    problems = gen_examples.hand_written_outputs({page: text})
    assert [p.split(": a ")[0] for p in problems] == ["docs/x.md:3", "docs/x.md:20", "docs/x.md:24"], problems
    assert "```console block outside <!-- gen:NAME --> markers ('$ stabletrain train out=o')" in problems[0]
    assert any("docs/x.md" in p for p in gen_examples.marker_problems({page: text}))


def test_marker_problems_are_found(monkeypatch):
    pages = {ROOT / "docs" / "x.md": "<!-- gen:nope -->\n```\n```\n<!-- /gen:nope -->\n<!-- gen:open -->\n"}
    problems = gen_examples.marker_problems(pages)
    assert any("gen:nope has no generator" in p for p in problems)
    assert any("gen:open" in p and "no matching" in p for p in problems)
    assert any("BLOCKS['tour-train'] has no" in p for p in problems)


def test_trims_keep_what_the_docs_promise():
    lines = [f"line {i}" for i in range(10)]
    assert gen_examples.head_tail(2, 1)(lines) == ["line 0", "line 1", "...", "line 9"]
    assert gen_examples.head_tail(5, 5)(lines) == lines
    assert gen_examples.pick(r"line [37]$")(lines) == ["...", "line 3", "...", "line 7", "..."]
    md = ["# T", "a", "## Next actions", "1. x", "", "2. y", "## Other", "z"]
    assert gen_examples.pick(r"^a$", sections=(r"^## Next",))(md) == ["...", "a", "## Next actions", "1. x", "",
                                                                       "2. y", "..."]
    assert gen_examples.pick(r"^x", last=(r"^line",))(["line 1", "line 2", "x"]) == ["...", "line 2", "x"]
    assert gen_examples.pick(r"^x", first=(r"^line",))(["line 1", "line 2", "x"]) == ["line 1", "...", "x"]
    row = {"step": 0, "loss": 5.56461, "lr": 2e-05, "x": 1}
    assert gen_examples.json_line(row, keys=["step", "lr"], digits=2) == '{"step": 0, ..., "lr": 2e-05, ...}'
    report = ["columns: abs min and abs max", "=== step 1 ===", "culprit: m", "", "      abs min     abs max  tensor",
              "[forward] step 0  a", "    1 2  w", "[forward] step 1  b", "    nan nan  x"]
    assert gen_examples.underflow_report(1)(report) == [*report[1:5], "...", *report[7:]]


@pytest.mark.slow
def test_cheap_examples_exit_as_documented_and_print_what_the_docs_show():
    """``gen_examples.py --check``: the settings errors, the missing logger and the plain-loop
    programs, run now, exit with their documented codes and print the docs' text."""
    run = subprocess.run([sys.executable, str(DOCS / "gen_examples.py"), "--check"], env=cli_env(),
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]


def test_mkdocs_builds_the_site_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")  # the API reference (the docs extra)
    exe = Path(sys.executable).with_name("mkdocs")
    argv = [str(exe)] if exe.exists() else [sys.executable, "-m", "mkdocs"]
    run = subprocess.run([*argv, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert (tmp_path / "site" / "diagnose" / "index.html").exists()
    assert 'id="stabletrain.training.loop.train"' in (tmp_path / "site" / "api" / "index.html").read_text()


# ----------------------------------------------------- the documented plain-loop programs
# (moved here from tests/debug/test_nan_capture.py and tests/debug/test_diagnose.py when the
# README's manual moved to docs/)


def _example(page: str, name: str) -> str:
    found = {m.group("name"): m.group("code") for m in gen_examples.EXAMPLE.finditer((DOCS / page).read_text())}
    assert name in found, f"docs/{page} has the <!-- example:{name} --> program"
    return found[name]


@pytest.mark.slow
def test_docs_plain_loop_example_runs_and_replays(tmp_path):
    """The nancapture page's complete example, run as a user would, prints the capture error
    and a reproduced replay, and the command in its message works when pasted."""
    (tmp_path / "example.py").write_text(_example("nancapture.md", "nancapture"))
    env = cli_env()
    env["PATH"] = str(Path(sys.executable).parent) + ":" + env.get("PATH", "")
    run = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Non-finite loss at step 4 (rank 0 of 1)." in run.stdout
    assert "reproduced: YES" in run.stdout and "losses: bitwise equal to the captured ones" in run.stdout
    command = re.search(r"Replay it offline:\n\s+(.+)", run.stdout).group(1)
    # Absolute paths, so that the command works when pasted in any folder (the docs show them
    # relative to the folder gen_examples.py ran in).
    capture, example = (shlex.quote(str(tmp_path / p)) for p in ("out/plain/nan_capture/rank0", "example.py"))
    assert command == f"stabletrain replay {capture} --model {example}:Net --step-fn {example}:my_step_fn"
    pasted = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert pasted.returncode == 0 and "reproduced: YES" in pasted.stdout, pasted.stderr[-2000:]


def test_docs_diagnose_example_is_what_the_code_prints(tmp_path, capsys, monkeypatch):
    """The plain-loop example, run and diagnosed as the diagnose page shows, prints the page's
    account line for line (all but the timing line)."""
    from stabletrain.cli import main

    (tmp_path / "example.py").write_text(_example("nancapture.md", "nancapture"))
    subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=cli_env(), check=True, capture_output=True,
                   timeout=300)
    block = re.search(r"\$ (stabletrain diagnose out/plain/[^\n]+)\n(.*?)```", (DOCS / "diagnose.md").read_text(), re.S)
    assert block, "the diagnose page shows the diagnosis of the plain-loop example"
    command, shown = block.group(1), block.group(2)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(shlex.split(command)[1:]) == 0
    printed = capsys.readouterr().out

    def untimed(text):
        return [line for line in text.strip().splitlines() if not line.startswith("Diagnosed in ")]

    # Commands name absolute paths; the page shows them relative to where it was generated, as
    # docs/gen_examples.py writes every output (Workspace.normalize).
    for root in {str(tmp_path.resolve()), str(tmp_path)}:
        printed = printed.replace(f"{root}/", "")

    assert untimed(printed) == untimed(shown)
    assert "The sample at dataset index 77 of microbatch 1" in printed
