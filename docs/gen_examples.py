#!/usr/bin/env python
"""Regenerate the example outputs in README.md and docs/*.md by running the documented commands.

Every output block sits between ``<!-- gen:NAME -->`` and ``<!-- /gen:NAME -->``. BLOCKS says how
NAME is made: from which RUNS (the documented commands, run in one temporary folder, so that
``out/boom`` in a command is ``out/boom`` in its output) and how their output is trimmed. Example
programs come from the docs themselves: the fenced block after ``<!-- example:NAME -->`` is written
to a file and run, so the code shown is the code that ran.

    python docs/gen_examples.py                  # every block (several minutes on 2 CPU cores)
    python docs/gen_examples.py --only report    # one block (or a run's blocks) and the runs it needs
    python docs/gen_examples.py --check          # markers <-> blocks; the cheap runs exit with their
                                                 # documented code and print what the docs show
    python docs/gen_examples.py --check --all    # ... and every run exits with its documented code
    python docs/gen_examples.py --list

To add a block: add a Run (unless an existing one prints what you need) and a Block below, put the
two markers where the output goes, and run ``--only NAME``. A ``console``, ``json``, ``text`` or
bare fenced block outside markers is refused (:func:`hand_written_outputs`): output comes from a
Run; a block that is no program's output says so with ``<!-- not-output: what it is -->`` on the
line before it. Timings in outputs (steps/s, ETA,
seconds) are whatever the generating machine measured; figures that matter live in benchmarks.md.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARKER = re.compile(r"<!-- gen:(?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- /gen:(?P=name) -->", re.S)
OPEN_MARKER = re.compile(r"<!-- (/?)gen:([\w.-]+) -->")
EXAMPLE = re.compile(r"<!-- example:(?P<name>[\w.-]+) -->\n```python\n(?P<code>.*?)```", re.S)
FENCE = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```", re.S | re.M)
#: Fenced blocks in these languages show what a program printed, unless the line before says
#: ``<!-- not-output: what it is -->`` (a tree drawn by hand, a table of hooks).
OUTPUT_LANGS = ("console", "json", "text", "")
NOT_OUTPUT = re.compile(r"<!-- not-output: [^>]+ -->\n$")
#: Hand-written output blocks left as they are, by page and first line, with the reason.
HAND_WRITTEN: dict[tuple[str, str], str] = {}


class GenError(Exception):
    """A documented command did not behave as documented, or a marker has no generator."""


# ------------------------------------------------------------------------------------------ runs


@dataclass
class Example:
    """The code of the docs block after ``<!-- example:NAME -->``."""

    name: str


@dataclass
class Run:
    """Shell commands as the docs show them, run in the workspace in order.

    Args:
        commands: The commands, or a function of the workspace that returns them (for a command
            that depends on an earlier output, e.g. the checkpoint a diagnosis names).
        code: The documented exit code of the last command; the others must exit with 0.
        needs: Runs whose outputs (files under out/) these commands read.
        files: Files written into the workspace first: name -> text or Example.
        hide: Modules made unimportable, to show what a user without them sees.
        cheap: A few seconds; ``--check`` runs it.
        stderr: Show what the commands print on stderr too (False: a framework's own log lines
            there are left out, as the docs say).
    """

    commands: Union[tuple[str, ...], Callable[["Workspace"], tuple[str, ...]]]
    code: int = 0
    needs: tuple[str, ...] = ()
    files: dict[str, Union[str, Example]] = field(default_factory=dict)
    hide: tuple[str, ...] = ()
    cheap: bool = False
    stderr: bool = True


# SGD at lr 1 with the default warmup: healthy for ~25 steps, then the weights grow until a
# float32 overflow at step ~38. Checkpoints every 10 steps keep a healthy one to resume from.
BOOM = ("stabletrain train out=out/boom model_args.optimizer=sgd model_args.lr=1 steps=100 "
        "checkpoint_every_num_steps=10 debug_args.nancapture.enabled=true")
BOOM_CAPTURE = "out/boom/debug/nan_capture/rank0"
TREND = ("stabletrain train out=out/trend model_args.optimizer=sgd model_args.lr=1 model_args.warmup_steps=20 "
         "steps=40 log_every_num_steps=1 gradient_norm_per_layer=true")
# docs/mechanisms.md: the tiny model of the reproductions (stabletrain.training.reproductions.TINY) at AdamW lr 0.1,
# no weight decay, no dropout: attention-logit growth, never a NaN.
ATTENTION = ("stabletrain train out=out/attention model_args.lr=0.1 model_args.weight_decay=0 model_args.dropout=0 "
             "model_args.n_layers=1 model_args.n_heads=2 model_args.dim=32 model_args.context_length=16 "
             "model_args.warmup_steps=5 batch_size=8 steps=200 checkpoint_every_num_steps=10")
PLAIN = "stabletrain diagnose out/plain/nan_capture/rank0 --model example.py:Net --step-fn example.py:my_step_fn"
# A 201-byte text file: 3 windows of 65 tokens, fewer than one batch of 32.
SMALL_TEXT = ("It was the best of times, it was the worst of times, " * 4)[:200] + "\n"
# The built-in language model at the tests' size (tests/conftest.py TINY_LM): a run of a few seconds.
TINY = ("batch_size=8 model_args.n_layers=1 model_args.n_heads=2 model_args.dim=32 model_args.context_length=16 "
        "model_args.dropout=0.0 log_every_num_steps=1")
# SIGTERM once step 20 is logged (as SLURM or Kubernetes would stop the job), then wait for the exit.
SIGTERM = ("stabletrain train out=out/term steps=1000 log_every_num_steps=1 & "
           "until grep -qs '\"step\": 20,' out/term/metrics.jsonl; do sleep 1; done; kill -TERM $!; wait $!")
# 42 images in two class folders, two of which cannot be read: a text file named .jpg, a JPEG cut short.
MAKE_IMAGES = """\
from pathlib import Path

from PIL import Image

for label in ("cat", "dog"):
    Path("images", label).mkdir(parents=True, exist_ok=True)
    for i in range(20):
        Image.new("RGB", (32, 32), (8 * i, 100, 200)).save(f"images/{label}/{i}.jpg")
Path("images/cat/20.jpg").write_text("not an image")
data = Path("images/dog/0.jpg").read_bytes()
Path("images/dog/cut.jpg").write_bytes(data[: len(data) // 2])
"""


def _example_files(name: str) -> dict[str, Union[str, Example]]:
    """An integration example as the repository has it, at the path its page shows."""
    return {f"examples/integrations/{name}": (ROOT / "examples" / "integrations" / name).read_text()}


def _resume_commands(ws: "Workspace") -> tuple[str, ...]:
    """Resume the boom run with the command its verified remedy printed (diagnose --verify)."""
    remedies = json.loads((ws.root / "out/boom/debug/remedies/remedies.json").read_text())
    best = next((r for r in remedies["ranked"] if r["candidate"]["name"] == remedies["best"]), None)
    if best is None or not best.get("command"):
        raise GenError("tour: diagnose --verify of the boom run verified no remedy (remedies.json has no best with a "
                       "command); the tour resumes with it, so change BOOM until one is verified")
    return (ws.normalize(best["command"]),)


# The tiny language model of tests/mechanism_runs.py at peak lr 0.1, without weight decay or dropout: its
# attention logits grow until the attention is one-hot and the loss stalls (docs/mechanisms.md#reproductions).
RUNS: dict[str, Run] = {
    "demo": Run(("stabletrain train out=out/demo",)),
    "boom": Run((BOOM,), code=1),
    "replay": Run((f"stabletrain replay {BOOM_CAPTURE}",), needs=("boom",)),
    "replay-64": Run((f"stabletrain replay {BOOM_CAPTURE} --precision 64-true",), needs=("boom",)),
    "diagnose": Run((f"stabletrain diagnose {BOOM_CAPTURE}",), needs=("boom",)),
    # After the plain diagnosis (docs/diagnose.md shows it): --verify rewrites diagnosis.md with its actions.
    "diagnose-verify": Run((f"stabletrain diagnose {BOOM_CAPTURE} --verify",), needs=("diagnose",)),
    "resume": Run(_resume_commands, needs=("diagnose-verify",)),
    "attention-verify": Run(("stabletrain report out/attention --verify --no-plots",), needs=("attention",)),
    "settings-errors": Run(("stabletrain train out=o model_args.lrr=0.1 steps=-1 precision=fp8",), code=2, cheap=True),
    "settings-errors-2": Run(("stabletrain train out=o steps=0 data=missing.txt strategy=dpp",), code=2, cheap=True),
    "settings-small-data": Run(("stabletrain train out=o data=t.txt        # a 201-byte file",), code=2,
                               files={"t.txt": SMALL_TEXT}, cheap=True),
    "own-model": Run(("python own_model.py",), files={"own_model.py": Example("own-model")}),
    "loaded-huge": Run(("python loaded.py",), files={"loaded.py": Example("loaded-huge")}, cheap=True, stderr=False),
    "layers": Run(("stabletrain train out=out/layers gradient_norm_per_layer=true steps=20",)),
    "logger-missing": Run(("stabletrain train out=out/x loggers.mlflow.enabled=true",), code=2,
                          hide=("mlflow",), cheap=True),
    "trend": Run((TREND,), code=1),  # the guard stops it at the first non-finite step
    "trends-offline": Run(("python trends.py",), files={"trends.py": Example("detect-trends")}, cheap=True),
    "report": Run(("stabletrain report out/trend",), needs=("trend",)),
    "uo": Run(("stabletrain train out=out/uo model_args.lr=1e20 guard.enabled=false "
              "debug_args.underflow_overflow.enabled=true",),
              code=1),
    "uo-plain": Run(("python siamese.py",), files={"siamese.py": Example("siamese")}, cheap=True),
    "plain": Run(("python example.py",), files={"example.py": Example("nancapture")}, cheap=True),
    "forward-backward": Run(("python dissect.py",), needs=("plain",), files={"dissect.py": Example("dissect")}),
    "diagnose-plain": Run((PLAIN,), needs=("plain",)),
    "ddp-train": Run(("python train.py",), code=1, files={"train.py": Example("ddp")}),
    "ddp-replay": Run(("stabletrain replay out/ddp/debug/nan_capture --model train.py:Net",), needs=("ddp-train",)),
    "fsdp": Run(("stabletrain train out=out/fsdp strategy=fsdp devices=2 accelerator=cpu steps=40 "
                 "model_args.warmup_steps=4",)),
    "mechanisms-plain": Run(("python example.py",), files={"example.py": Example("mechanisms")}, cheap=True),
    # The benchmark as the repository has it, run from the workspace (its default --out is out/lr_sensitivity).
    "lr-sensitivity": Run(("python benchmarks/lr_sensitivity.py",),
                          files={"benchmarks/lr_sensitivity.py": (ROOT / "benchmarks/lr_sensitivity.py").read_text()}),
    "heal": Run(("python heal.py",), files={"heal.py": Example("heal")}),
    # docs/blowups.md
    "explode": Run(("stabletrain train out=out/explode model_args.lr=1e3 steps=60",), code=1),
    "half": Run((f"stabletrain train out=out/half precision=16-true {TINY} debug_args.nancapture.enabled=true",),
                code=1),
    "half-diagnose": Run(("stabletrain diagnose out/half/debug/nan_capture/rank0",), needs=("half",)),
    "diverge": Run((f"stabletrain train out=out/diverge model_args.optimizer=sgd model_args.lr=3 {TINY} steps=40 "
                    "model_args.warmup_steps=10 checkpoint_every_num_steps=2 max_checkpoints_to_keep=1",), code=1),
    "sigterm": Run((SIGTERM,), code=143),
    # docs/checkpoints.md
    "cut-checkpoint": Run(("stabletrain train out=out/cut steps=20 checkpoint_every_num_steps=10",
                           "truncate -s 0 out/cut/checkpoints/last.ckpt",
                           "stabletrain train out=out/cut steps=30 resume_interrupted=true"), code=2),
    # docs/training.md
    "bad-images": Run(("python make_images.py", "stabletrain train out=o model=cnn data=images"), code=2,
                      files={"make_images.py": MAKE_IMAGES}, cheap=True),
    "warmup-warning": Run(("stabletrain train out=out/warm steps=20 model_args.warmup_steps=50",)),
    # docs/benchmarks.md
    "gpu-check-skip": Run(('CUDA_VISIBLE_DEVICES="" bash benchmarks/gpu_check.sh',), cheap=True, files={
        f"benchmarks/{f}": (ROOT / "benchmarks" / f).read_text() for f in ("gpu_check.sh", "gpu_check.py")}),
    # docs/integrations/: the example files as the repository has them
    "hf-example": Run(("python examples/integrations/hf_trainer_example.py out/hf_trainer",), code=1,
                      files=_example_files("hf_trainer_example.py")),
    "hf-diagnose": Run(("stabletrain diagnose out/hf_trainer/debug/nan_capture/rank0",), needs=("hf-example",)),
    "lightning-example": Run(("python examples/integrations/lightning_example.py out/lightning",), code=1,
                             files=_example_files("lightning_example.py"), stderr=False),
    "lightning-diagnose": Run(("stabletrain diagnose out/lightning/debug/nan_capture/rank0 "
                               "--model examples/integrations/lightning_example.py:SiameseLit",),
                              needs=("lightning-example",)),
    "accelerate-example": Run(("torchrun --nproc_per_node 2 examples/integrations/accelerate_example.py "
                               "out/accelerate",), code=1, files=_example_files("accelerate_example.py"), stderr=False),
    "accelerate-diagnose": Run(("stabletrain diagnose out/accelerate/debug/nan_capture "
                                "--model examples/integrations/accelerate_example.py:Siamese "
                                "--step-fn examples/integrations/accelerate_example.py:step_fn",),
                               needs=("accelerate-example",)),
    "attention": Run((ATTENTION,)),
    "attention-report": Run(("stabletrain report out/attention",), needs=("attention",)),
    "attention-diagnose": Run(("stabletrain diagnose out/attention",), needs=("attention",)),
    "cnn-signals": Run(("stabletrain train out=out/cnn task=image_classification steps=2",), cheap=True),
    "false-alarms": Run(("python benchmarks/mechanism_false_alarms.py",),
                        files={"benchmarks/mechanism_false_alarms.py":
                               (ROOT / "benchmarks/mechanism_false_alarms.py").read_text()}),
    "lead-time": Run(("python benchmarks/mechanism_lead_time.py",),
                     files={"benchmarks/mechanism_lead_time.py":
                            (ROOT / "benchmarks/mechanism_lead_time.py").read_text()}),
}


# ----------------------------------------------------------------------------------- trimming

Trim = Callable[[list[str]], list[str]]


def head_tail(head: int, tail: int) -> Trim:
    """The first ``head`` and last ``tail`` lines, with ``...`` between when lines were left out."""

    def trim(lines: list[str]) -> list[str]:
        if len(lines) <= head + tail + 1:
            return lines
        return [*lines[:head], "...", *lines[len(lines) - tail:]]

    return trim


def pick(*patterns: str, sections: tuple[str, ...] = (), last: tuple[str, ...] = (), first: tuple[str, ...] = (),
         before: int = 0, after: int = 0) -> Trim:
    """Lines matching a pattern (with ``before``/``after`` lines around them), the first line matching
    each of ``first``, the last line matching each of ``last``, and every line of the Markdown
    sections whose heading matches one of ``sections``; ``...`` where lines were left out."""

    def trim(lines: list[str]) -> list[str]:
        keep: set[int] = set()
        section = False
        for i, line in enumerate(lines):
            if line.startswith("#"):
                section = any(re.search(s, line) for s in sections)
            if section or any(re.search(p, line) for p in patterns):
                keep.update(range(max(0, i - before), min(len(lines), i + after + 1)))
        for p in last:
            keep.update([i for i, line in enumerate(lines) if re.search(p, line)][-1:])
        for p in first:
            keep.update([i for i, line in enumerate(lines) if re.search(p, line)][:1])
        out: list[str] = []
        for i, line in enumerate(lines):
            if i in keep:
                if line.strip() or (out and out[-1].strip()):
                    out.append(line)
            elif line.strip() and out[-1:] != ["..."]:  # a left-out blank line is no gap worth a "..."
                out.append("...")
        return out

    return trim


def chain(*trims: Trim) -> Trim:
    """The trims one after the other."""

    def trim(lines: list[str]) -> list[str]:
        for t in trims:
            lines = t(lines)
        return lines

    return trim


def drop(*patterns: str) -> Trim:
    """Every line but those matching a pattern."""
    return lambda lines: [line for line in lines if not any(re.search(p, line) for p in patterns)]


def underflow_report(frames: int, summary: bool = True) -> Trim:
    """An underflow_overflow report: its summary (without the header lines above it) and its last
    ``frames`` frames; without ``summary`` the frames alone."""

    def trim(lines: list[str]) -> list[str]:
        heads = [i for i, line in enumerate(lines) if re.match(r"\[(forward|backward)\] ", line)]
        if not heads:
            raise GenError("an underflow_overflow report without frames")
        first = heads[-frames] if len(heads) >= frames else heads[0]
        if not summary:
            return lines[first:]
        start = next(i for i, line in enumerate(lines) if line.startswith("=== "))
        table = next(i for i, line in enumerate(lines) if i > start and re.match(r"\s+abs min\s+abs max", line))
        return [*lines[start:table + 1], *(["..."] if first > table + 1 else []), *lines[first:]]

    return trim


def json_line(row: dict, keys: Optional[list[str]] = None, digits: Optional[int] = None) -> str:
    """One metrics row as JSON; with ``keys``, only those (in row order) and ``...`` for the gaps;
    with ``digits``, floats to that many significant digits."""

    def value(v: object) -> str:
        if digits is not None and isinstance(v, float):
            v = float(f"{v:.{digits}g}")  # significant digits: an lr of 2e-05 stays 2e-05
        return json.dumps(v)

    if keys is None:
        return "{" + ", ".join(f"{json.dumps(k)}: {value(v)}" for k, v in row.items()) + "}"
    parts: list[str] = []
    for k, v in row.items():
        if k in keys:
            parts.append(f"{json.dumps(k)}: {value(v)}")
        elif parts[-1:] != ["..."]:
            parts.append("...")
    return "{" + ", ".join(parts) + "}"


# ------------------------------------------------------------------------------------ blocks


@dataclass
class Block:
    """What goes between the markers of one name: ``render(workspace)`` after ``runs`` have run.

    ``exact``: the output has no timing in it, so ``--check`` compares it with the docs.
    ``copy``: files of the workspace copied into the repository (plots shown in the docs).
    """

    runs: tuple[str, ...]
    render: Callable[["Workspace"], str]
    exact: bool = False
    copy: dict[str, str] = field(default_factory=dict)


def console(*runs: str, trim: Optional[Trim] = None, exact: bool = False, last: bool = False) -> Block:
    """The runs' commands, each after ``$``, and their output (trimmed), as a console block; with
    ``last``, only each run's last command (the ones before it prepare its input, as the docs say)."""

    def render(ws: "Workspace") -> str:
        text: list[str] = []
        for run in runs:
            for command, output in ws.outputs[run][-1:] if last else ws.outputs[run]:
                text.append(f"$ {command}")
                lines = output.splitlines()
                text.extend(_rstrip(trim(lines) if trim else lines))
        return fence("console", text)

    return Block(runs, render, exact=exact)


def output_only(run: str, trim: Optional[Trim] = None, exact: bool = False) -> Block:
    """The output of a run's last command without the command (after a code example)."""

    def render(ws: "Workspace") -> str:
        lines = ws.outputs[run][-1][1].splitlines()
        return fence("console", _rstrip(trim(lines) if trim else lines))

    return Block((run,), render, exact=exact)


def file_block(run: str, path: str, trim: Optional[Trim] = None, lang: str = "text") -> Block:
    """A file the run wrote, trimmed."""

    def render(ws: "Workspace") -> str:
        lines = ws.normalize((ws.root / path).read_text()).splitlines()
        return fence(lang, trim(lines) if trim else lines)

    return Block((run,), render)


def metrics_row(run: str, path: str, where: Callable[[dict], bool], command: bool = False, **kwargs) -> Block:
    """The first row of a metrics.jsonl for which ``where`` holds, as a json block; with
    ``command``, after a bash block with the run's commands."""

    def render(ws: "Workspace") -> str:
        rows = [json.loads(line) for line in (ws.root / path).read_text().splitlines() if line.strip()]
        row = next((r for r in rows if where(r)), None)
        if row is None:
            raise GenError(f"{path}: no row as the docs show (of {len(rows)} rows)")
        shown = fence("json", [ws.normalize(json_line(row, **kwargs))])
        return (fence("bash", [c for c, _ in ws.outputs[run]]) + "\n" + shown) if command else shown

    return Block((run,), render)


def console_then_markdown(run: str) -> Block:
    """The run's command and the lines of its output that are not a markdown table as a console
    block, then the tables (lines starting with ``|``) as markdown, a blank line between two."""

    def render(ws: "Workspace") -> str:
        (command, output), = ws.outputs[run]
        lines = output.splitlines()
        text = [line for line in lines if not line.startswith("|")]
        tables: list[list[str]] = []
        for i, line in enumerate(lines):
            if line.startswith("|"):
                if not tables or not lines[i - 1].startswith("|"):
                    tables.append([])
                tables[-1].append(line)
        shown = fence("console", [f"$ {command}", *_rstrip([t for t in text if t.strip()])])
        return shown + "\n" + "\n\n".join("\n".join(t) for t in tables) + "\n"

    return Block((run,), render)


def _rstrip(lines: list[str]) -> list[str]:
    """Without trailing blank lines."""
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def fence(lang: str, lines: list[str]) -> str:
    return f"```{lang}\n" + "\n".join(lines) + "\n```\n"


def _trend_alert(kind: str, signal: str) -> Callable[[dict], bool]:
    return lambda r: r.get("event") == "trend_alert" and r.get("kind") == kind and r.get("signal") == signal


LAYER_KEYS = ["step", "loss", "gradient_norm", "lr", "gradient_norm/tok_emb.weight", "gradient_norm/pos_emb.weight",
              "gradient_norm/blocks.0.ln1.weight", "gradient_norm/blocks.0.attn", "gradient_norm/blocks"]

#: The keys of a metrics row docs/training.md shows (the signals/... keys after them are in docs/mechanisms.md).
DEMO_KEYS = ["step", "loss", "gradient_norm", "lr", "epoch", "samples", "elapsed_s", "steps_per_s", "samples_per_s",
             "eta_s"]
#: The signals/... keys of the default language model shown in docs/mechanisms.md.
MECHANISM_KEYS = ["step", "loss", *(f"signals/{k}/blocks.{i}.attn" for i in (0, 1) for k in ("attn_logit_max",
                                                                                           "attn_entropy")),
                  *(f"signals/{k}" for k in ("attn_logit_max", "attn_entropy_min", "output_logsumexp",
                                             "output_logit_absmax", "weight_rms/decay", "weight_rms/no_decay",
                                             "update_rms/decay", "update_rms/no_decay", "update_rms_max",
                                             "update_rms_argmax", "adam_eps_fraction"))]

BLOCKS: dict[str, Block] = {
    # README.md and docs/index.md: the tour
    "tour-train": console("demo", trim=head_tail(3, 1)),
    "tour-boom": console("boom", trim=pick(r"NaNDetectedError", r"^Replay it", r"^    stabletrain", r"^No non-finite",
                                           r"^It carries", last=(r"^step ",))),
    "tour-replay": console("replay", trim=pick(r"reproduced:", r"losses:")),
    "tour-diagnose": console("diagnose-verify", trim=pick(r"^\*\*Verdict", r"^First harmful non-finite op",
                                                          r"^Checkpoints:", r"^## Next actions", r"^1\. ")),
    "tour-resume": console("resume", trim=head_tail(3, 1)),
    # docs/training.md
    "train-demo": console("demo", trim=head_tail(5, 2)),
    "bad-images": console("bad-images", exact=True, last=True),
    "warmup-warning": console("warmup-warning", trim=pick(r"^Warning: ")),
    "demo-metrics-row": metrics_row("demo", "out/demo/metrics.jsonl", lambda r: r.get("step") == 10 and "loss" in r,
                                    keys=DEMO_KEYS),
    "settings-errors": console("settings-errors", "settings-errors-2", exact=True),
    "settings-small-data": console("settings-small-data", exact=True),
    "own-model": output_only("own-model", trim=pick(r"^stabletrain ", r"^task ", r"^Done", first=(r"^step ",),
                                                    last=(r".",))),
    # docs/blowups.md
    "loaded-huge": output_only("loaded-huge", trim=pick(r"^Before the optimizer", r"^Next:", r"^  - ")),
    # docs/gradient_norm.md
    "layers-row": metrics_row("layers", "out/layers/metrics.jsonl", lambda r: r.get("step") == 0 and "loss" in r,
                              keys=LAYER_KEYS, digits=4, command=True),
    # docs/loggers.md
    "logger-missing": console("logger-missing", exact=True),
    # docs/trend_alerts.md
    "trend-run": console("trend", trim=pick(r"^WARNING", r"^  next:", before=1)),
    "trend-row": metrics_row("trend", "out/trend/metrics.jsonl", _trend_alert("exploding", "gradient_norm")),
    "trends-offline": output_only("trends-offline", exact=True),
    # docs/report.md
    "report": Block(("report",), console("report").render, copy={
        "out/trend/report/gradient_norm.png": "docs/img/report_gradient_norm.png",
        "out/trend/report/gradient_norm_layers.png": "docs/img/report_gradient_norm_layers.png",
    }),
    # docs/underflow_overflow.md
    "uo-run": console("uo"),
    "uo-log": file_block("uo", "out/uo/debug/underflow_overflow_rank0.log", trim=underflow_report(5)),
    "uo-plain": output_only("uo-plain", exact=True),
    "uo-plain-log": file_block("uo-plain", "out/debug/underflow_overflow_rank0.log",
                               trim=underflow_report(3, summary=False)),
    # docs/nancapture.md
    "nan-boom": console("boom"),
    "nan-replay": console("replay", "replay-64"),
    "nan-plain": console("plain", exact=True),
    "forward-backward": output_only("forward-backward", exact=True),
    "ddp-replay": console("ddp-replay"),
    # docs/diagnose.md
    "diagnose-boom": console("diagnose"),
    "diagnose-plain": console("diagnose-plain"),
    # docs/checkpoints.md
    "resume": console("resume", trim=pick(r"^stabletrain ", r"^task ", r"^Resumed from", r"^Done", first=(r"^step ",))),
    # docs/distributed.md
    "fsdp-run": output_only("fsdp", trim=pick(r"^All distributed", r"^task ", r"^step ", r"^Done")),
    # docs/mechanisms.md
    "mechanisms-row": metrics_row("demo", "out/demo/metrics.jsonl", lambda r: r.get("step") == 0 and "loss" in r,
                                  keys=MECHANISM_KEYS, digits=3),
    "mechanisms-plain": console("mechanisms-plain"),
    "cnn-signals": console("cnn-signals", trim=pick(r"^Signals: ")),
    "mechanism-alert": console("attention", trim=pick(r"^WARNING mechanism", r"^  next", r"^  the newest",
                                                      r"^The run finished", r"^Done", first=(r"^step ",))),
    "mechanism-row": metrics_row("attention", "out/attention/metrics.jsonl", lambda r: r.get("event") == "mechanism",
                                 keys=["event", "step", "id", "name", "where", "start_step", "detected_step",
                                       "evidence", "follows"], digits=3),
    "mechanism-report": console("attention-report", trim=drop(r"^written:")),
    "mechanism-diagnose": console("attention-diagnose"),
    "lead-time": console_then_markdown("lead-time"),
    "false-alarms": console_then_markdown("false-alarms"),
    "lr-sensitivity": Block(("lr-sensitivity",), console_then_markdown("lr-sensitivity").render,
                            copy={"out/lr_sensitivity/lr_sensitivity.png": "docs/img/lr_sensitivity.png"}),
    # docs/benchmarks.md
    "gpu-check-skip": console("gpu-check-skip"),
    # docs/blowups.md
    "explode": console("explode", trim=drop(r"^Signals: ")),
    "half": console("half", trim=pick(r"NonFiniteStepError", r"^Training stopped", r"^It carries", r"^Next:",
                                      r"^  - ")),
    "half-diagnose": console("half-diagnose", trim=pick(r"^\*\*Verdict", sections=(r"^## What happened", r"^## Why",
                                                                                  r"^## Next actions"))),
    "diverge-health": console("diverge", trim=pick(r"^The newest healthy checkpoint", r"^It carries")),
    "sigterm": console("sigterm", trim=pick(r"^SIGTERM", r"^Continue with")),
    # docs/checkpoints.md
    "cut-checkpoint": console("cut-checkpoint", trim=pick(r"^Done", r"cannot read")),
    # docs/integrations/
    "hf-example": console("hf-example"),
    "hf-diagnose": console("hf-diagnose", trim=head_tail(34, 0)),
    "hf-next-actions": file_block("hf-diagnose", "out/hf_trainer/debug/nan_capture/rank0/diagnosis.md",
                                  trim=pick(sections=(r"^## Next actions",))),
    "lightning-example": console("lightning-example"),
    "lightning-diagnose": console("lightning-diagnose"),
    "accelerate-example": console("accelerate-example"),
    "accelerate-diagnose": console("accelerate-diagnose", trim=pick(r"^# Diagnosis", r"^\*\*Verdict",
                                                                    sections=(r"^## Which data",))),
    # docs/remedies.md
    "remedies": console("diagnose-verify", trim=pick(r"^Verifying ", r"^\[\d+/\d+\] ", r"^Added ",
                                                     r"^verification cost", sections=(r"^# Verified remedies",))),
    "remedies-attention": console("attention", "attention-verify", trim=pick(
        r"^Done", r"^verdict:", r"^Verifying ", r"^\[\d+/\d+\] ", r"^Next actions", r"^\d+\. ",
        sections=(r"^# Verified remedies",))),
    # docs/self_healing.md
    "heal": console("heal", trim=pick(r"^Recovered step ", r"^Diagnosis of the recovery at step 6:", r"^Done")),
}


# --------------------------------------------------------------------------------- workspace


class Workspace:
    """A temporary folder where the runs happen, with ``stabletrain`` and ``python`` on PATH running
    this checkout's sources."""

    def __init__(self, root: Path, examples: dict[str, str], verbose: bool = True):
        self.root, self.examples, self.verbose = root, examples, verbose
        self.outputs: dict[str, list[tuple[str, str]]] = {}
        self.seconds: dict[str, float] = {}
        bin_dir = root / ".bin"
        bin_dir.mkdir()
        wrappers = (("stabletrain", f'"{sys.executable}" -m stabletrain'), ("python", f'"{sys.executable}"'),
                    ("python3", f'"{sys.executable}"'), ("torchrun", f'"{sys.executable}" -m torch.distributed.run'))
        for name, argv in wrappers:
            (bin_dir / name).write_text(f'#!/bin/sh\nexec {argv} "$@"\n')
            (bin_dir / name).chmod(0o755)
        hide_dir = root / ".hide"
        hide_dir.mkdir()
        # A module set to None in sys.modules is one that find_spec and import do not find.
        (hide_dir / "sitecustomize.py").write_text(
            "import os, sys\nfor _m in os.environ.get('DOCS_HIDE_MODULES', '').split(','):\n"
            "    if _m:\n        sys.modules[_m] = None\n"
        )
        self.env = dict(os.environ)
        self.env.update(
            PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            PYTHONPATH=str(ROOT / "src"),
            PYTHONUNBUFFERED="1",
            MPLBACKEND="Agg",
            MPLCONFIGDIR=str(root / ".matplotlib"),
        )
        # Fixed threads: the same numbers on every regeneration on a given machine.
        self.env.setdefault("OMP_NUM_THREADS", "2")
        self.hide_dir = hide_dir

    def relative(self, path: str) -> str:
        p = Path(path)
        return str(p.relative_to(self.root)) if p.is_absolute() and p.is_relative_to(self.root) else path

    def normalize(self, text: str) -> str:
        """The workspace's absolute paths as the documented relative ones; no trailing spaces."""
        text = text.replace(f"{self.root}/", "").replace(str(self.root), ".")
        text = text.replace(f"{ROOT / 'src'}/", "")
        return "\n".join(line.rstrip() for line in text.splitlines())

    def _write_files(self, name: str, spec: Run) -> None:
        for file, content in spec.files.items():
            if isinstance(content, Example):
                if content.name not in self.examples:
                    raise GenError(f"run {name}: no <!-- example:{content.name} --> python block in the docs")
                content = self.examples[content.name]
            (self.root / file).parent.mkdir(parents=True, exist_ok=True)
            (self.root / file).write_text(content)

    def _env(self, spec: Run) -> dict[str, str]:
        env = dict(self.env)
        if spec.hide:
            env["PYTHONPATH"] = f"{self.hide_dir}{os.pathsep}{env['PYTHONPATH']}"
            env["DOCS_HIDE_MODULES"] = ",".join(spec.hide)
        return env

    def run(self, name: str) -> None:
        if name in self.outputs:
            return
        if name not in RUNS:
            raise GenError(f"unknown run {name!r}; runs: {', '.join(RUNS)}")
        spec = RUNS[name]
        for need in spec.needs:
            self.run(need)
        self._write_files(name, spec)
        env = self._env(spec)
        commands = spec.commands(self) if callable(spec.commands) else spec.commands
        start = time.perf_counter()
        outputs = []
        for i, command in enumerate(commands):
            proc = subprocess.run(["bash", "-c", command], cwd=self.root, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT if spec.stderr else subprocess.DEVNULL, text=True,
                                  timeout=3600)
            expected = spec.code if i == len(commands) - 1 else 0
            if proc.returncode != expected:
                raise GenError(f"run {name}: `{command}` exited with {proc.returncode}, the docs say {expected}; "
                               f"its output ends:\n{proc.stdout[-3000:]}")
            outputs.append((command, self.normalize(proc.stdout)))
        self.outputs[name] = outputs
        self.seconds[name] = time.perf_counter() - start
        if self.verbose:
            print(f"  ran {name:<20} {self.seconds[name]:6.1f}s", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------- pages


def read_pages() -> dict[Path, str]:
    return {p: p.read_text() for p in PAGES if p.exists()}


def examples_of(pages: dict[Path, str]) -> dict[str, str]:
    found: dict[str, str] = {}
    for text in pages.values():
        for m in EXAMPLE.finditer(text):
            found[m.group("name")] = m.group("code")
    return found


def hand_written_outputs(pages: dict[Path, str]) -> list[str]:
    """Fenced blocks that look like a program's output (console, json, text or no language) outside
    ``<!-- gen:NAME -->`` markers: output that no command here produced."""
    problems = []
    for path, text in pages.items():
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        spans = [m.span() for m in MARKER.finditer(text)]
        for m in FENCE.finditer(text):
            if m.group("lang") not in OUTPUT_LANGS or any(a <= m.start() < b for a, b in spans):
                continue
            if NOT_OUTPUT.search(text[:m.start()]):
                continue
            first = m.group("body").split("\n", 1)[0]
            if any(str(where) == page and first.startswith(line) for page, line in HAND_WRITTEN):
                continue
            line = text[:m.start()].count("\n") + 1
            problems.append(f"{where}:{line}: a ```{m.group('lang')} block outside <!-- gen:NAME --> markers "
                            f"({first[:60]!r}): generate it (a Run and a Block here), or say what it is with "
                            "<!-- not-output: ... --> on the line before when it is no program's output")
    return problems


def marker_problems(pages: dict[Path, str]) -> list[str]:
    """Markers without a block, blocks without a marker, markers that are not closed, and output
    blocks outside markers (:func:`hand_written_outputs`)."""
    problems, used = hand_written_outputs(pages), set()
    for path, text in pages.items():
        where = path.relative_to(ROOT)
        closed = {m.group("name") for m in MARKER.finditer(text)}
        for m in OPEN_MARKER.finditer(text):
            name = m.group(2)
            if name not in closed:
                problems.append(f"{where}: <!-- {m.group(1)}gen:{name} --> has no matching "
                                f"<!-- {'' if m.group(1) else '/'}gen:{name} --> right after its block")
        for name in closed:
            used.add(name)
            if name not in BLOCKS:
                problems.append(f"{where}: gen:{name} has no generator; add it to BLOCKS in docs/gen_examples.py "
                                "or remove the markers")
    problems += [f"BLOCKS[{name!r}] has no <!-- gen:{name} --> marker in README.md or docs/" for name in BLOCKS
                 if name not in used]
    run_examples = {c.name for run in RUNS.values() for c in run.files.values() if isinstance(c, Example)}
    problems += [f"<!-- example:{name} --> is run by no Run in docs/gen_examples.py (add one, so it stays true)"
                 for name in examples_of(pages) if name not in run_examples]
    problems += [f"RUNS uses <!-- example:{name} -->, which no page has" for name in run_examples
                 if name not in examples_of(pages)]
    return problems


def selected(only: list[str]) -> list[str]:
    """Block names for ``--only``: a block's name, or a run's name for every block that shows it."""
    names: list[str] = []
    for name in only:
        hits = [name] if name in BLOCKS else [b for b, block in BLOCKS.items() if name in block.runs]
        if not hits:
            raise GenError(f"--only {name}: neither a block nor a run; blocks: {', '.join(BLOCKS)}")
        names += [h for h in hits if h not in names]
    return names


def generate(names: list[str], verbose: bool = True) -> dict[str, str]:
    pages = read_pages()
    with tempfile.TemporaryDirectory(prefix="stabletrain-docs-") as tmp:
        ws = Workspace(Path(tmp).resolve(), examples_of(pages), verbose)
        rendered = {}
        for name in names:
            block = BLOCKS[name]
            for run in block.runs:
                ws.run(run)
            rendered[name] = block.render(ws)
            for src, dest in block.copy.items():
                shutil.copyfile(ws.root / src, ROOT / dest)
    return rendered


def write(rendered: dict[str, str]) -> list[Path]:
    changed = []
    for path, text in read_pages().items():
        def replace(m: re.Match) -> str:
            body = rendered.get(m.group("name"), m.group("body"))
            return f"<!-- gen:{m.group('name')} -->\n{body}<!-- /gen:{m.group('name')} -->"

        new = MARKER.sub(replace, text)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


def check(all_runs: bool) -> list[str]:
    """Marker problems, then the runs' exit codes (cheap ones, or all), then exact blocks against the docs."""
    pages = read_pages()
    problems = marker_problems(pages)
    if problems:
        return problems
    runs = [name for name, run in RUNS.items() if all_runs or run.cheap]
    with tempfile.TemporaryDirectory(prefix="stabletrain-docs-") as tmp:
        ws = Workspace(Path(tmp).resolve(), examples_of(pages), verbose=False)
        for name in runs:
            try:
                ws.run(name)
            except GenError as exc:
                problems.append(str(exc))
        shown = {m.group("name"): m.group("body") for text in pages.values() for m in MARKER.finditer(text)}
        for name, block in BLOCKS.items():
            if block.exact and all(r in ws.outputs for r in block.runs):
                now = block.render(ws)
                if now != shown[name]:
                    diff = "\n".join(difflib.unified_diff(shown[name].splitlines(), now.splitlines(), "docs", "now",
                                                          lineterm=""))
                    problems.append(f"gen:{name} is stale; rerun: python docs/gen_examples.py --only {name}\n{diff}")
    return problems


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="blocks (or runs) to regenerate")
    parser.add_argument("--check", action="store_true", help="verify, write nothing")
    parser.add_argument("--all", action="store_true", help="with --check: run every command, not only the cheap ones")
    parser.add_argument("--list", action="store_true", help="list blocks and the runs they show")
    ns = parser.parse_args(argv)
    try:
        if ns.list:
            for name, block in BLOCKS.items():
                cheap = all(RUNS[r].cheap for r in block.runs)
                print(f"{name:<22} {', '.join(block.runs)}{'  (cheap)' if cheap else ''}")
            return 0
        if ns.check:
            problems = check(ns.all)
            for p in problems:
                print(p, file=sys.stderr)
            print(f"{len(problems)} problem(s)" if problems else "docs examples: OK", file=sys.stderr)
            return 1 if problems else 0
        problems = marker_problems(read_pages())
        if problems and not ns.only:
            raise GenError("\n".join(problems))
        start = time.perf_counter()
        rendered = generate(selected(ns.only) if ns.only else list(BLOCKS))
        changed = write(rendered)
        print(f"{len(rendered)} block(s) in {time.perf_counter() - start:.0f}s; changed: "
              f"{', '.join(str(p.relative_to(ROOT)) for p in changed) or 'nothing'}", file=sys.stderr)
        return 0
    except GenError as exc:
        print(f"gen_examples: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
