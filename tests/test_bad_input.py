"""Bad input gets a clear error, and nothing is lost (issue 15, section 3).

Each test feeds one kind of bad input, asserts the message, and asserts that nothing under
``out/`` was created (the error comes before training) or changed (a run already there).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import numpy as np
import pytest
from PIL import Image
from pydantic import BaseModel

import stabletrain
from conftest import cli_env, run_cli, tiny_lm
from stabletrain.config import (
    COMMON_FABRIC_NAMES,
    TrainSettings,
    fabric_choices,
    load_settings,
    parse_cli_overrides,
)
from stabletrain.data.images import find_bad_images, image_problem
from stabletrain.errors import ConfigError
from stabletrain.runfiles.checkpoint import CheckpointError, fallback_advice, load_checkpoint, unreadable_reason


def snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``folder``: its size and content hash."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# ------------------------------------------------------------------------------------------
# 1. Unreadable images
# ------------------------------------------------------------------------------------------


def _encoded(fmt: str, seed: int = 0, size: int = 16) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt)
    return buf.getvalue()


def image_folder(root: Path, per_class: int = 20) -> Path:
    """Two classes of ``per_class`` readable 16x16 images, JPEG and PNG alternating."""
    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            fmt, ext = ("JPEG", "jpg") if i % 2 else ("PNG", "png")
            (root / c / f"{i:02d}.{ext}").write_bytes(_encoded(fmt, seed=i + 100 * (c == "dog")))
    return root


IMAGE_RUN = {"model": "cnn", "transform_args": {"image_size": 16}, "model_args": {"cnn_width": 4, "warmup_steps": 0},
             "batch_size": 8, "steps": 2, "log_every_num_steps": 1}


@pytest.mark.parametrize(
    "name, data, expected",
    [
        ("empty.jpg", b"", "the file is empty (0 bytes)"),
        ("text.jpg", b"not an image\n", "not an image file PIL can read"),
        ("header.jpg", _encoded("JPEG")[:300], "truncated"),
        ("cut.jpg", _encoded("JPEG")[:-100], "truncated"),
        ("cut.png", _encoded("PNG")[:-40], "truncated"),
        ("cut.bmp", _encoded("BMP")[:-100], "truncated"),
        ("cut.gif", _encoded("GIF")[:-60], "truncated"),
        ("cut.tiff", _encoded("TIFF")[:-100], "truncated"),
        ("cut.ppm", _encoded("PPM")[:-100], "truncated"),
        ("cut.webp", _encoded("WEBP")[:-20], "decoder"),
    ],
)
def test_image_problem_finds_empty_foreign_and_cut_files(tmp_path, name, data, expected):
    path = tmp_path / name
    path.write_bytes(data)
    [(found, reason)] = find_bad_images([path]).items()
    assert found == path and expected.lower() in reason.lower(), reason
    # What the check says cannot be read, the dataset cannot read either (PIL's decode).
    with pytest.raises(OSError), Image.open(path) as img:
        img.convert("RGB")


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "BMP", "GIF", "WEBP", "TIFF", "PPM"])
def test_image_problem_accepts_whole_files_of_every_format(tmp_path, fmt):
    path = tmp_path / f"ok.{fmt.lower()}"
    path.write_bytes(_encoded(fmt))
    assert image_problem(path) is None


def test_jpeg_with_bytes_after_the_image_is_decoded_and_accepted(tmp_path):
    # No end marker at the very end: the check falls back to a full decode, which succeeds.
    path = tmp_path / "padded.jpg"
    path.write_bytes(_encoded("JPEG") + b"\x00" * 64)
    assert image_problem(path) is None


def test_corrupt_image_among_40_is_listed_before_anything_is_written(tmp_path):
    data = image_folder(tmp_path / "images")
    (data / "cat" / "20.jpg").write_bytes(b"\x89 garbage, not a JPEG")
    (data / "dog" / "cut.jpg").write_bytes(_encoded("JPEG", seed=7)[:200])
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        stabletrain.train(out=out, data=str(data), **IMAGE_RUN)
    [problem] = info.value.problems
    assert problem.startswith(f"data: 2 of 42 images in {data} cannot be read: cat/20.jpg (not an image file PIL "
                              "can read), dog/cut.jpg (")
    assert problem.endswith("; remove or replace them, or set data_args.bad_images=skip to train without them")
    assert not out.exists()


def test_corrupt_image_on_the_command_line_exits_2_without_traceback(tmp_path):
    data = image_folder(tmp_path / "images")
    (data / "dog" / "bad.jpg").write_bytes(b"")
    result = run_cli("train", "out=run", "data=images", "model=cnn", "transform_args.image_size=16", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "data: 1 of 41 images in images cannot be read: dog/bad.jpg (the file is empty (0 bytes))" in result.stderr
    assert not (tmp_path / "run").exists()


def test_bad_images_skip_trains_without_them_and_lists_them_in_train_log(tmp_path, capsys):
    data = image_folder(tmp_path / "images")
    (data / "cat" / "zz.jpg").write_bytes(b"garbage")
    out = tmp_path / "run"
    result = stabletrain.train(out=out, data=str(data), data_args={"bad_images": "skip"}, **IMAGE_RUN)
    assert result.steps_done == 2
    warning = (f"Warning: data_args.bad_images=skip: 1 of 41 images in {data} cannot be read: cat/zz.jpg (not an "
               "image file PIL can read); training without them")
    assert capsys.readouterr().out.count(warning) == 1
    log = (out / "train.log").read_text()
    assert log.count(warning) == 1 and "40 samples" in log
    assert json.loads((out / "settings.json").read_text())["data_args"] == {"bad_images": "skip"}


def test_skipping_every_image_of_a_class_is_an_error(tmp_path):
    data = image_folder(tmp_path / "images", per_class=4)
    for p in (data / "dog").iterdir():
        p.write_bytes(b"")
    with pytest.raises(ConfigError, match=r"class folders without readable images in .*: 'dog'"):
        stabletrain.train(out=tmp_path / "run", data=str(data), data_args={"bad_images": "skip"}, **IMAGE_RUN)
    assert not (tmp_path / "run").exists()


def test_bad_images_setting_is_refused_for_the_language_model(tmp_path):
    with pytest.raises(ConfigError) as info:
        stabletrain.train(out=tmp_path / "run", **tiny_lm(data_args={"bad_images": "skip"}))
    assert info.value.problems == [
        ("data_args.bad_images: only image folders are checked for unreadable files, not used by the "
         "language_model task (got 'skip')")
    ]


def test_an_image_broken_after_the_check_names_the_file(tmp_path):
    from stabletrain.data.images import ImageFolderDataset, ImageTransform

    data = image_folder(tmp_path / "images", per_class=2)
    ds = ImageFolderDataset(data, ImageTransform(16, (0.5,) * 3, (0.25,) * 3))
    path, _ = ds.samples[1]
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"cannot read the image {path}: .*remove or replace the file"):
        ds[1]


# ------------------------------------------------------------------------------------------
# 2. Unreadable checkpoints
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """4 steps with a checkpoint at step 2 (step_000002.ckpt) and the last state (last.ckpt, step 4)."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    stabletrain.train(out=out, **tiny_lm(steps=4, checkpoint_every_num_steps=2))
    return out


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("damage", ["empty", "cut"])
def test_unreadable_last_ckpt_names_the_newest_readable_one(tmp_path, trained_run, damage):
    out = _copy_run(trained_run, tmp_path / "run")
    last = out / "checkpoints" / "last.ckpt"
    last.write_bytes(b"" if damage == "empty" else last.read_bytes()[:5000])
    before = snapshot(out)
    with pytest.raises(ConfigError) as info:
        stabletrain.train(out=out, **tiny_lm(steps=6, checkpoint_every_num_steps=2, resume_interrupted=True))
    [problem] = info.value.problems
    why = "the file is empty (0 bytes)" if damage == "empty" else "the file is cut short or is not a checkpoint"
    step2 = out / "checkpoints" / "step_000002.ckpt"
    assert problem.startswith(f"resume_interrupted: cannot read {last}: {why}")
    # The run's own command, continuing from step 2 in place of resume_interrupted.
    assert f". The newest healthy checkpoint is {step2} (step 2); continue from it: stabletrain train out=" in problem
    assert problem.endswith(f" resume_from={shlex.quote(str(step2))}") and "resume_interrupted" not in problem[30:]
    assert snapshot(out) == before, "nothing under out/ may change"

    # Reading it directly (as diagnose would) names the same file, and that one loads.
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(last)
    message = str(info.value)
    assert message.startswith(f"cannot read checkpoint {last}: {why}")
    assert message.endswith(f"The newest healthy checkpoint is {step2} (step 2); continue from it: "
                            f"resume_from={shlex.quote(str(step2))}")
    assert load_checkpoint(step2)["step"] == 2
    assert snapshot(out) == before


@pytest.mark.slow
def test_printed_command_for_an_unreadable_last_ckpt_resumes_from_the_named_one(tmp_path, trained_run):
    out = _copy_run(trained_run, tmp_path / "my run")  # a space: the command must quote it
    (out / "checkpoints" / "last.ckpt").write_bytes(b"")
    settings = tiny_lm(steps=4, checkpoint_every_num_steps=2)  # trained_run's
    args = [f"{k}={json.dumps(v)}" for k, v in settings.items() if k != "model_args"]
    args += [f"model_args.{k}={json.dumps(v)}" for k, v in settings["model_args"].items()]
    result = run_cli("train", f"out={out}", *args, "resume_interrupted=true", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    command = result.stderr.split("continue from it: ", 1)[1].strip()
    assert command.startswith("stabletrain train ") and "resume_interrupted" not in command
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = cli_env()
    env["PATH"] = str(Path(sys.executable).parent) + ":" + env.get("PATH", "")  # the venv's stabletrain
    pasted = subprocess.run(command, shell=True, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert pasted.returncode == 0, pasted.stderr[-2000:]
    assert f"Resumed from step 2: {out / 'checkpoints' / 'step_000002.ckpt'}" in pasted.stdout
    assert load_checkpoint(out / "checkpoints" / "last.ckpt")["step"] == 4


def test_unreadable_resume_from_file_names_the_newest_healthy_one(tmp_path, trained_run):
    out = _copy_run(trained_run, tmp_path / "run")
    step2, last = out / "checkpoints" / "step_000002.ckpt", out / "checkpoints" / "last.ckpt"
    step2.write_bytes(step2.read_bytes()[:3000])
    before = snapshot(out)
    with pytest.raises(ConfigError) as info:
        stabletrain.train(out=out, **tiny_lm(steps=6, checkpoint_every_num_steps=2, resume_from=step2))
    [problem] = info.value.problems
    assert problem.startswith(f"resume_from: cannot read {step2}: the file is cut short or is not a checkpoint")
    assert f". The newest healthy checkpoint is {last} (step 4); continue from it: stabletrain train " in problem
    assert problem.endswith(f" resume_from={shlex.quote(str(last))}")
    assert snapshot(out) == before


def test_empty_resume_from_is_an_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        stabletrain.train(out=tmp_path / "run", resume_from="", **tiny_lm())
    assert info.value.problems == ["resume_from: empty; give a checkpoint file, e.g. "
                                   "resume_from=out/my_run/checkpoints/step_000200.ckpt, or leave the setting out "
                                   "(got '')"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("folder", ["absent", "empty", "file"])
def test_resume_interrupted_without_a_run_says_there_is_none(tmp_path, folder):
    """There was no run at all: "the run stopped before its first checkpoint; start again with
    overwrite=true" claimed a run that never was, and asked to overwrite nothing."""
    out = tmp_path / "run"
    if folder == "empty":
        out.mkdir()
    elif folder == "file":
        out.write_text("x")
    with pytest.raises(ConfigError) as info:
        stabletrain.train(out=out, resume_interrupted=True, **tiny_lm(steps=2))
    [problem] = info.value.problems
    what = {"absent": f"{out} does not exist", "empty": f"{out} is empty", "file": f"{out} is a file, not a run folder"}
    assert problem.startswith(f"resume_interrupted: no checkpoint to resume from at {out}/checkpoints/last.ckpt: "
                              f"{what[folder]}"), problem
    assert "stopped before its first checkpoint" not in problem and "overwrite=true" not in problem
    assert (out.is_dir() and not any(out.iterdir())) if folder == "empty" else (out.is_file() or not out.exists())


def test_resume_from_a_missing_file_names_the_checkpoints_the_run_has(tmp_path, trained_run):
    out = _copy_run(trained_run, tmp_path / "run")
    with pytest.raises(ConfigError) as info:
        stabletrain.train(out=out, resume_from=out / "checkpoints" / "step_999.ckpt", **tiny_lm(steps=8))
    [problem] = info.value.problems
    assert problem.startswith(f"resume_from: no checkpoint file at {out}/checkpoints/step_999.ckpt; pass a .ckpt "
                              f"file; the run in {out} has "), problem
    assert str(out / "checkpoints" / "last.ckpt") in problem
    with pytest.raises(ConfigError) as info:
        stabletrain.train(out=tmp_path / "new", resume_from=tmp_path / "x.ckpt", **tiny_lm(steps=8))
    assert info.value.problems == [f"resume_from: no checkpoint file at {tmp_path / 'x.ckpt'}; pass the .ckpt file "
                                   f"of a run; {tmp_path / 'new'} has none ({tmp_path / 'new' / 'checkpoints'} holds "
                                   "no .ckpt file)"]


def test_unreadable_checkpoint_without_an_alternative_says_start_again(tmp_path, trained_run):
    out = _copy_run(trained_run, tmp_path / "run")
    for p in (out / "checkpoints").iterdir():
        p.write_bytes(b"")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(out / "checkpoints" / "last.ckpt")
    assert str(info.value).endswith(f"No other checkpoint in {out / 'checkpoints'} can be read; start again: "
                                    "overwrite=true")
    result = run_cli("train", f"out={out}", "resume_interrupted=true", "steps=6", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (f"can be read; start again: stabletrain train out={out} steps=6 overwrite=true"
            in " ".join(result.stderr.split()))


def _rewrite_health(path: Path, health: Any) -> None:
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    if health is None:
        state.pop("health", None)
    else:
        state["health"] = health
    torch.save(state, path)


def test_unreadable_checkpoint_prefers_a_healthy_one_and_says_when_none_is(tmp_path, trained_run):
    out = _copy_run(trained_run, tmp_path / "run")
    folder = out / "checkpoints"
    last, step2 = folder / "last.ckpt", folder / "step_000002.ckpt"
    (folder / "step_000003.ckpt").write_bytes(last.read_bytes())  # step 4's state under another name
    _rewrite_health(folder / "step_000003.ckpt", {"healthy": False, "why": "loss at step 3 is 88, 16x the median"})
    last.write_bytes(b"")
    # The newer file is readable but not healthy: the healthy step 2 is named.
    assert fallback_advice(last).startswith(f"The newest healthy checkpoint is {step2} (step 2);")
    # Written by an older stabletrain (no health recorded): named, and said so.
    _rewrite_health(step2, None)
    assert fallback_advice(last) == (
        f"The newest readable checkpoint is {step2}, step 2 (health not recorded: written by an older "
        f"stabletrain); continue from it: resume_from={shlex.quote(str(step2))}")
    # Only unhealthy ones: start again, and the newest is named with why.
    _rewrite_health(step2, {"healthy": False, "why": "the weight norm is 1e3, 500x its start"})
    assert fallback_advice(last) == (
        f"No other checkpoint in {folder} is healthy (the newest, {folder / 'step_000003.ckpt'}, is step 4 "
        "(not healthy: loss at step 3 is 88, 16x the median)); start again: overwrite=true")


def test_corrupt_checkpoint_contents_fail_with_the_reason_not_an_index_error(tmp_path, trained_run):
    # Whole as a zip (the quick check passes) but not a checkpoint inside: torch.load's own error.
    out = _copy_run(trained_run, tmp_path / "run")
    last = out / "checkpoints" / "last.ckpt"
    import zipfile

    with zipfile.ZipFile(last, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02garbage")
    assert unreadable_reason(last) is None
    with pytest.raises(CheckpointError, match=r"cannot read checkpoint .*last.ckpt: RuntimeError: .*The newest "
                                              r"healthy checkpoint is .*step_000002.ckpt \(step 2\)"):
        load_checkpoint(last)


# ------------------------------------------------------------------------------------------
# 3. Booleans are not numbers
# ------------------------------------------------------------------------------------------


def _takes_numbers(ann: Any) -> bool:
    if ann in (int, float):
        return True
    if get_origin(ann) is Literal:
        return False
    return any(_takes_numbers(a) for a in get_args(ann))


def _numeric_settings(model: type[BaseModel] = TrainSettings, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted name, a boolean in the shape the setting takes) for every setting that takes numbers."""
    found = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            found += _numeric_settings(ann, prefix + name + ".")
        elif _takes_numbers(ann):
            # A list or a tuple of numbers gets booleans inside it.
            if get_origin(ann) in (list, tuple):
                found.append((prefix + name, [True] * len([a for a in get_args(ann) if a is not Ellipsis])))
            else:
                found.append((prefix + name, True))
    return found


def _nested(dotted: str, value: Any) -> dict[str, Any]:
    *groups, last = dotted.split(".")
    data: dict[str, Any] = {last: value}
    for g in reversed(groups):
        data = {g: data}
    return data


NUMERIC = _numeric_settings()


def test_every_number_setting_is_found():
    names = [n for n, _ in NUMERIC]
    assert {"steps", "batch_size", "devices", "num_workers", "model_args.lr", "model_args.betas",
            "debug_args.underflow_overflow.trace_batch_nums", "trend_alerts.z"} <= set(names)
    assert len(names) >= 35, names


@pytest.mark.parametrize("dotted, value", NUMERIC, ids=[n for n, _ in NUMERIC])
def test_true_is_refused_by_every_number_setting(dotted, value):
    with pytest.raises(ConfigError) as info:
        load_settings({"out": "o", **_nested(dotted, value)})
    [problem] = info.value.problems
    assert problem.startswith(dotted) and "not true/false (got True)" in problem, problem


def test_batch_size_true_on_the_command_line_is_an_error(tmp_path):
    result = run_cli("train", "out=run", "batch_size=true", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == ("stabletrain train: Invalid setting:\n"
                             "  - batch_size: expected a whole number, not true/false (got True)\n")
    assert not any(tmp_path.iterdir())


def test_whole_floats_are_taken_and_fractions_refused():
    assert load_settings({"out": "o", "steps": 2.0}).steps == 2
    assert load_settings(parse_cli_overrides(["out=o", "steps=1e4"])).steps == 10000
    assert isinstance(load_settings({"out": "o", "batch_size": 64.0}).batch_size, int)
    with pytest.raises(ConfigError, match=r"steps: Input should be a valid integer, got a number with a fractional "
                                          r"part \(got 2.5\)"):
        load_settings({"out": "o", "steps": 2.5})
    # Booleans stay booleans where a boolean is asked for.
    assert load_settings({"out": "o", "overwrite": True}).overwrite is True


# ------------------------------------------------------------------------------------------
# 4. Repeated keys
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, expected",
    [
        (["steps=10", "steps=20"], "steps: given 2 times (steps=10, steps=20); give each setting once"),
        (["model_args.lr=1", "steps=1", "model_args.lr=2"],
         "model_args.lr: given 2 times (model_args.lr=1, model_args.lr=2); give each setting once"),
        (['model_args={"lr": 1}', "model_args.lr=2"],
         ('model_args: given as a whole and by key (model_args={"lr": 1}, model_args.lr=2); give the group once, '
          "or only its keys")),
        (["model_args.dim=8", 'model_args={"lr": 1}'],
         ('model_args: given as a whole and by key (model_args.dim=8, model_args={"lr": 1}); give the group once, '
          "or only its keys")),
    ],
)
def test_a_repeated_key_is_an_error_listing_the_repeats(args, expected):
    with pytest.raises(ConfigError) as info:
        parse_cli_overrides(["out=o", *args])
    assert info.value.problems == [expected]


def test_several_repeats_are_listed_at_once_and_distinct_keys_pass():
    with pytest.raises(ConfigError) as info:
        parse_cli_overrides(["steps=1", "seed=1", "steps=2", "seed=2", "steps=3"])
    assert info.value.problems == [
        "steps: given 3 times (steps=1, steps=2, steps=3); give each setting once",
        "seed: given 2 times (seed=1, seed=2); give each setting once",
    ]
    assert parse_cli_overrides(["model_args.lr=1", "model_args.dim=8"]) == {"model_args": {"lr": 1, "dim": 8}}


def test_repeated_steps_on_the_command_line_exits_2_before_anything_is_written(tmp_path):
    result = run_cli("train", "out=run", "steps=10", "steps=20", cwd=tmp_path)
    assert result.returncode == 2
    assert "steps: given 2 times (steps=10, steps=20); give each setting once" in result.stderr
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------
# 5. An empty out
# ------------------------------------------------------------------------------------------


def test_empty_out_is_an_error_in_python_and_on_the_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    expected = "out: empty; give an output folder, e.g. out=out/my_run (out=. for the current folder) (got '')"
    with pytest.raises(ConfigError) as info:
        stabletrain.train(out="", **tiny_lm())
    assert info.value.problems == [expected]
    result = run_cli("train", "out=", "steps=1", cwd=tmp_path)
    assert result.returncode == 2 and expected in result.stderr
    assert not any(tmp_path.iterdir()), "nothing may be written to the current folder"


# ------------------------------------------------------------------------------------------
# 6. Warmup longer than the run
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "warmup, expected",
    [
        (10, ("model_args.warmup_steps=10 is not below steps=4: the learning rate rises for the whole run, never "
              "reaches model_args.lr=0.001 (it ends at 40% of it), and the cosine schedule after warmup never "
              "starts; lower model_args.warmup_steps (e.g. 0, no warmup) or raise steps")),
        (4, ("model_args.warmup_steps=4 is not below steps=4: the learning rate rises for the whole run, reaches "
             "model_args.lr only at the last step, and the cosine schedule")),
    ],
)
def test_warmup_not_below_steps_warns_once_on_the_console_and_in_train_log(tmp_path, capsys, warmup, expected):
    out = tmp_path / "run"
    stabletrain.train(out=out, **tiny_lm(model_args={"warmup_steps": warmup}))
    printed = capsys.readouterr().out
    assert printed.count("Warning: model_args.warmup_steps=") == 1 and f"Warning: {expected}" in printed
    log = (out / "train.log").read_text()
    assert log.count("Warning: model_args.warmup_steps=") == 1 and expected in log
    # The warning describes the schedule the trainer ran: the last step's learning rate.
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"lr"' in line][-1]
    assert last["lr"] == pytest.approx(1e-3 * min(1.0, 4 / warmup))


def test_warmup_below_steps_does_not_warn(tmp_path, capsys):
    stabletrain.train(out=tmp_path / "run", **tiny_lm(model_args={"warmup_steps": 3}))
    assert "Warning" not in capsys.readouterr().out


# ------------------------------------------------------------------------------------------
# 7. Settings errors before torch loads
# ------------------------------------------------------------------------------------------

_NO_TORCH = """
import sys
from stabletrain.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:  # argparse's --help
    code = exc.code
loaded = sorted(m for m in ("torch", "lightning_fabric", "torchvision") if m in sys.modules)
print("LOADED", loaded, "EXIT", code)
"""


def _cli_without_torch(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _NO_TORCH, *args], cwd=cwd, env=cli_env(), capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--help"], "commands:"),
        (["train", "--help"], "data_args.bad_images"),
        (["train", "out=run", "steps=-1"], "steps: Input should be greater than or equal to 1 (got -1)"),
        (["train", "out=run", "stesp=3"], "stesp: unknown setting. Did you mean 'steps'?"),
        (["train", "out=run", "steps=1", "steps=2"], "steps: given 2 times"),
        (["train", "out=run", "batch_size=true"], "batch_size: expected a whole number"),
        (["train", "out="], "out: empty"),
        (["train", "out=run", "precision=fp8", "accelerator=cpu", "strategy=ddp"], "precision: Input should be"),
        (["train", "out=run", "data=missing.txt"], "data: file not found: missing.txt"),
        (["train", "out=run", "model=cnn", "data=missing", "steps=0"], "data: folder not found: missing"),
        (["train", "out=full"], "out: full is not empty"),
        (["train", "out=full", "resume_interrupted=true"], "resume_interrupted: no checkpoint to resume from"),
        (["train", "out=full", "resume_from=full/none.ckpt"], "resume_from: no checkpoint file at full/none.ckpt"),
        (["train", "out=run", "resume_from="], "resume_from: empty; give a checkpoint file"),
    ],
)
def test_settings_errors_and_help_come_before_torch_is_imported(tmp_path, args, expected):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "metrics.jsonl").write_text("{}\n")
    result = _cli_without_torch(tmp_path, *args)
    assert result.stdout.strip().endswith("LOADED [] EXIT " + ("0" if "--help" in args else "2")), result.stdout
    assert expected in result.stdout + result.stderr


_WRONG_PATHS = [
    ("nowhere", "NaNCaptureError: no such file or folder: nowhere"),
    ("run/metrics.jsonl", "NaNCaptureError: run/metrics.jsonl is not a stabletrain NaN capture (a capture is a "
                          "file torch.save wrote, and this one is not); give the capture's folder, e.g. "
                          "stabletrain {command} out/boom/debug/nan_capture/rank0, or the run folder"),
    ("run", "NaNCaptureError: no NaN capture in run: no nan_capture.pt in it or in its subfolders"),
]


# diagnose reads a run folder without a capture (its logged signals): the next test.
@pytest.mark.parametrize(
    "command, path, expected",
    [(c, p, e) for c in ("replay", "diagnose") for p, e in _WRONG_PATHS if (c, p) != ("diagnose", "run")],
)
def test_replay_and_diagnose_answer_a_wrong_path_before_torch_is_imported(tmp_path, command, path, expected):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0, "loss": 2.7}\n')
    result = _cli_without_torch(tmp_path, command, path)
    assert result.stdout.strip().endswith("LOADED [] EXIT 1"), result.stdout + result.stderr
    assert f"stabletrain {command}: " + expected.format(command=command) in result.stderr
    assert "Traceback" not in result.stderr


def test_diagnose_of_a_run_without_a_capture_reads_its_signals_and_says_nothing_failed(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0, "loss": 2.7}\n')
    result = _cli_without_torch(tmp_path, "diagnose", "run")
    assert result.stdout.strip().endswith("EXIT 0"), result.stdout + result.stderr
    assert "No NaN capture: the run logged steps 0-0 and its loss stayed finite" in result.stdout
    assert "no mechanism named" in result.stdout
    assert (tmp_path / "run" / "debug" / "diagnosis.json").is_file()
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "path, expected",
    [
        ("nowhere", "StabletrainError: nowhere: no such folder; pass the out folder of a training run"),
        ("run/metrics.jsonl", "StabletrainError: run/metrics.jsonl: a file, not a folder; pass the out folder"),
        ("run/checkpoints", "StabletrainError: no metrics.jsonl in run/checkpoints: pass the out folder"),
    ],
    ids=["missing", "file", "no-metrics"],
)
def test_report_answers_a_wrong_folder_before_torch_is_imported(tmp_path, path, expected):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0, "loss": 2.7}\n')
    result = _cli_without_torch(tmp_path, "report", path)
    assert result.stdout.strip().endswith("LOADED [] EXIT 1"), result.stdout + result.stderr
    assert "stabletrain report: " + expected in result.stderr, result.stderr


@pytest.mark.parametrize("command", ["replay", "diagnose"])
def test_a_folder_holding_a_capture_file_goes_on_to_the_loader(tmp_path, command):
    # Deep down (a recovery's capture) and damaged: the check before torch lets it through, and
    # the loader, with torch, says what is wrong with it.
    damaged = tmp_path / "run" / "debug" / "recoveries" / "step12" / "rank0" / "nan_capture.pt"
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"not a zip")
    result = _cli_without_torch(tmp_path, command, "run/debug/recoveries/step12")
    assert "'torch'" in result.stdout and result.stdout.strip().endswith("EXIT 1"), result.stdout
    assert "the file is truncated or corrupt" in result.stderr, result.stderr


def test_importing_stabletrain_and_its_settings_does_not_import_torch(tmp_path):
    code = ("import sys, stabletrain, stabletrain.config, stabletrain.training.preflight, stabletrain.cli; "
            "print(sorted(m for m in ('torch', 'lightning_fabric', 'PIL') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=cli_env(), capture_output=True, text=True)
    assert result.stdout.strip() == "[]", result.stderr


def test_common_fabric_names_are_fabric_names():
    # They are accepted without asking Fabric; each must be one Fabric accepts.
    for setting, names in COMMON_FABRIC_NAMES.items():
        assert names <= set(fabric_choices(setting)), setting  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------
# 8. Commands work from any folder
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_printed_replay_and_diagnose_commands_work_from_another_folder(tmp_path):
    (tmp_path / "start").mkdir()
    (tmp_path / "elsewhere").mkdir()
    args = ["train", "out=boom", "steps=10", "batch_size=8", "model_args.n_layers=1", "model_args.n_heads=2",
            "model_args.dim=32", "model_args.context_length=16", "model_args.optimizer=sgd", "model_args.lr=1000",
            "model_args.warmup_steps=0", "debug_args.nancapture.enabled=true"]
    trained = run_cli(*args, cwd=tmp_path / "start")  # out relative to where training ran
    assert trained.returncode == 1, trained.stderr[-2000:]
    command = trained.stderr.split("Replay it offline:\n", 1)[1].splitlines()[0].strip()
    capture = tmp_path / "start" / "boom" / "debug" / "nan_capture" / "rank0"
    assert command == f"stabletrain replay {shlex.quote(str(capture))}"

    env = cli_env()
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    replayed = subprocess.run(command, shell=True, cwd=tmp_path / "elsewhere", env=env, capture_output=True,
                              text=True, timeout=300)
    assert replayed.returncode == 0 and "reproduced: YES" in replayed.stdout, replayed.stderr[-2000:]

    diagnosed = subprocess.run(command.replace("stabletrain replay", "stabletrain diagnose", 1) + " --no-write",
                               shell=True, cwd=tmp_path / "elsewhere", env=env, capture_output=True, text=True,
                               timeout=600)
    assert diagnosed.returncode == 0, diagnosed.stderr[-2000:]
    assert f"Replay the step yourself: {command}" in diagnosed.stdout


# ------------------------------------------------------------------------------------------
# 9. The header names the architecture
# ------------------------------------------------------------------------------------------


def test_torchvision_task_header_names_the_architecture(tmp_path, capsys):
    out = tmp_path / "run"
    stabletrain.train(out=out, model="torchvision/resnet18", batch_size=4, steps=1, transform_args={"image_size": 32})
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("task "))
    assert header.startswith("task image_classification: torchvision/resnet18 with 11,178,564 parameters")
    assert "TorchvisionClassifier" not in (out / "train.log").read_text()
