"""The checkpoint files of a run, without training: what is written where, rotation (and the newest
healthy checkpoint it keeps), the free-space check, temporaries, reading back, the reasons a file
cannot be read, and where to continue from when one cannot (docs/checkpoints.md)."""

from __future__ import annotations

import datetime
import errno
import json
import pickle
import zipfile

import pytest
import torch

from stabletrain.runfiles import checkpoint as ck
from stabletrain.utils.text import shell_path


def _state(step: int, healthy: bool | None = True, why: str = "fine") -> dict:
    state = {"step": step, "model": {"w": torch.full((4,), float(step))}}
    if healthy is not None:
        state["health"] = {"healthy": healthy, "why": why}
    return state


def _names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_checkpoint_is_written_as_last_ckpt_and_a_periodic_one_as_both(tmp_path):
    out = tmp_path / "run"
    last = ck.save_checkpoint(_state(3), out, periodic=False, keep=5)
    folder = out / "checkpoints"
    assert last == folder / "last.ckpt" and _names(folder) == ["last.ckpt"]
    state = ck.load_checkpoint(last)
    assert (state["format"], state["version"], state["step"]) == ("stabletrain.runfiles.checkpoint", 1, 3)
    assert torch.equal(state["model"]["w"], torch.full((4,), 3.0))
    saved_at = datetime.datetime.fromisoformat(state["saved_at"])
    assert saved_at.utcoffset() == datetime.timedelta(0), "saved_at is in UTC"
    ck.save_checkpoint(_state(4), out, periodic=True, keep=5)
    assert _names(folder) == ["last.ckpt", "step_000004.ckpt"]
    assert (folder / "last.ckpt").read_bytes() == (folder / "step_000004.ckpt").read_bytes()
    assert ck.periodic_name(12) == "step_000012.ckpt" and ck.checkpoint_dir(out) == folder


def test_rotation_keeps_the_newest_periodic_files(tmp_path):
    out = tmp_path / "run"
    for step in range(1, 6):
        ck.save_checkpoint(_state(step), out, periodic=True, keep=2)
    assert _names(out / "checkpoints") == ["last.ckpt", "step_000004.ckpt", "step_000005.ckpt"]
    ck.save_checkpoint(_state(6), out, periodic=True, keep=0)
    assert _names(out / "checkpoints") == ["last.ckpt"]
    assert ck.load_checkpoint(out)["step"] == 6


def test_rotation_keeps_the_newest_healthy_checkpoint_while_the_newest_is_not(tmp_path):
    out = tmp_path / "run"
    for step, healthy in ((1, True), (2, True), (3, False), (4, False)):
        ck.save_checkpoint(_state(step, healthy), out, periodic=True, keep=1)
    assert _names(out / "checkpoints") == ["last.ckpt", "step_000002.ckpt", "step_000004.ckpt"]
    best = ck.newest_healthy(out / "checkpoints")
    assert best is not None and (best.step, best.path.name) == (2, "step_000002.ckpt")
    # Healthy again: rotation goes back to keeping the newest only.
    ck.save_checkpoint(_state(5, True), out, periodic=True, keep=1)
    assert _names(out / "checkpoints") == ["last.ckpt", "step_000005.ckpt"]


def test_no_healthy_checkpoint_before_a_step_says_whether_any_was_written(tmp_path):
    """"No checkpoint from before step 20 is healthy" claims there are some; with none written by
    then the message says that instead (step_000020.ckpt holds steps 0-19: it is from before step 20)."""
    out = tmp_path / "run"
    folder = out / "checkpoints"
    assert ck.none_healthy_before(folder, 20) == "no checkpoint was written before step 20"
    ck.save_checkpoint(_state(30, False, "exploding"), out, periodic=True, keep=5)
    assert ck.none_healthy_before(folder, 20) == "no checkpoint was written before step 20"
    ck.save_checkpoint(_state(20, False, "exploding"), out, periodic=True, keep=5)
    assert ck.none_healthy_before(folder, 20) == "no checkpoint from before step 20 is healthy"
    assert ck.none_healthy_before(folder, 19) == "no checkpoint was written before step 19"


def test_an_unhealthy_checkpoint_does_not_overwrite_the_only_copy_of_the_newest_healthy_one(tmp_path):
    out = tmp_path / "run"
    ck.save_checkpoint(_state(3, True), out, periodic=False, keep=1)
    ck.save_checkpoint(_state(5, False, "exploding"), out, periodic=False, keep=1)
    folder = out / "checkpoints"
    assert _names(folder) == ["last.ckpt", "step_000003.ckpt"]
    assert ck.load_checkpoint(folder / "step_000003.ckpt")["step"] == 3 and ck.load_checkpoint(out)["step"] == 5
    # A healthy one that already has its periodic file is not copied again; a healthy write copies nothing.
    ck.save_checkpoint(_state(6, True), out, periodic=False, keep=1)
    assert _names(folder) == ["last.ckpt", "step_000003.ckpt"]


def test_not_enough_space_is_refused_before_writing(tmp_path, monkeypatch):
    from stabletrain.utils import io

    out = tmp_path / "run"
    ck.save_checkpoint(_state(1), out, periodic=False, keep=1)
    last = out / "checkpoints" / "last.ckpt"
    size = last.stat().st_size
    before = last.read_bytes()
    needed = int(size * 1.05) + 2**16  # the last checkpoint is larger than this state's tensors
    monkeypatch.setattr(io, "free_bytes", lambda folder: needed - 1)
    with pytest.raises(ck.NotEnoughSpaceError) as info:
        ck.save_checkpoint(_state(2), out, periodic=False, keep=1)
    err = info.value
    assert (err.errno, err.needed, err.free, err.filename) == (errno.ENOSPC, needed, needed - 1, str(last))
    assert f"not enough free space for the checkpoint ({needed / 2**20:,.1f} MiB needed, " in str(err)
    assert last.read_bytes() == before
    monkeypatch.setattr(io, "free_bytes", lambda folder: needed)
    ck.save_checkpoint(_state(2), out, periodic=False, keep=1)  # exactly enough
    # A periodic checkpoint is written twice (step_N.ckpt and its copy as last.ckpt).
    monkeypatch.setattr(io, "free_bytes", lambda folder: 2 * needed - 1)
    with pytest.raises(ck.NotEnoughSpaceError) as info:
        ck.save_checkpoint(_state(3), out, periodic=True, keep=1)
    assert info.value.needed == 2 * needed and info.value.filename == str(out / "checkpoints" / "step_000003.ckpt")
    monkeypatch.setattr(io, "free_bytes", lambda folder: None)  # unknown: not checked
    ck.save_checkpoint(_state(3), out, periodic=True, keep=1)


def test_the_free_space_check_counts_the_state_s_tensors(tmp_path, monkeypatch):
    from stabletrain.utils import io

    big = {"step": 1, "model": {"w": torch.zeros(100_000)}}  # 400,000 bytes, no checkpoint yet
    needed = int(400_000 * 1.05) + 2**16
    monkeypatch.setattr(io, "free_bytes", lambda folder: needed - 1)
    with pytest.raises(ck.NotEnoughSpaceError) as info:
        ck.check_free_space(big, tmp_path, periodic=False)
    assert info.value.needed == needed and info.value.filename == str(tmp_path / "last.ckpt")


def test_remove_temporaries_removes_only_the_dot_tmp_files_of_killed_writers(tmp_path):
    out = tmp_path / "run"
    ck.save_checkpoint(_state(1), out, periodic=False, keep=1)
    stray = [out / ".metrics.jsonl.x1.tmp", out / "checkpoints" / ".last.ckpt.y2.tmp"]
    for p in stray:
        p.write_bytes(b"partial")
    (out / "keep.tmp").write_text("not a temporary of ours")
    assert sorted(ck.remove_temporaries(out)) == sorted(stray)
    assert not any(p.exists() for p in stray) and (out / "keep.tmp").exists()
    assert ck.remove_temporaries(tmp_path / "nothing") == []


def test_load_checkpoint_finds_last_ckpt_and_names_the_fallback_when_missing(tmp_path):
    out = tmp_path / "run"
    ck.save_checkpoint(_state(2), out, periodic=True, keep=3)
    assert ck.load_checkpoint(out)["step"] == 2
    assert ck.load_checkpoint(out / "checkpoints")["step"] == 2
    (out / "checkpoints" / "last.ckpt").unlink()
    with pytest.raises(ck.CheckpointError) as info:
        ck.load_checkpoint(out)
    missing = out / "checkpoints" / "last.ckpt"
    assert str(info.value) == (f"no checkpoint at {missing}. The newest healthy checkpoint is "
                               f"{out / 'checkpoints' / 'step_000002.ckpt'} (step 2); continue from it: "
                               f"resume_from={shell_path(out / 'checkpoints' / 'step_000002.ckpt')}")
    older = tmp_path / "older.ckpt"
    torch.save({"format": "stabletrain.runfiles.checkpoint", "step": 1}, older)  # no version: format 0
    assert ck.load_checkpoint(older)["step"] == 1


def test_unreadable_reasons(tmp_path):
    assert ck.unreadable_reason(tmp_path / "none.ckpt") == "cannot open it (No such file or directory)"
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    assert ck.unreadable_reason(empty) == "the file is empty (0 bytes)"
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(b"x" * 1234)
    assert ck.unreadable_reason(cut) == ("the file is cut short or is not a checkpoint (1,234 bytes without the index "
                                         "torch.save writes last)")
    other_zip = tmp_path / "other.zip"
    with zipfile.ZipFile(other_zip, "w") as z:
        z.writestr("a.txt", "a")
        z.writestr("b.txt", "b")
    assert ck.unreadable_reason(other_zip) == ("the file is a zip archive but not a torch checkpoint (no FOLDER/data.pkl, "
                                               "which torch.save writes, among its 2 entries)")
    # A checkpoint's entries moved out of their folder: torch.load refuses it, and so does the check.
    flat = tmp_path / "flat.ckpt"
    torch.save({"a": 1}, tmp_path / "whole.ckpt")
    with zipfile.ZipFile(tmp_path / "whole.ckpt") as whole, zipfile.ZipFile(flat, "w") as z:
        for name in whole.namelist():
            z.writestr(name.split("/", 1)[1], whole.read(name))
    assert "data.pkl" in zipfile.ZipFile(flat).namelist()
    with pytest.raises(RuntimeError, match="not in a subdirectory"):
        torch.load(flat, weights_only=True)
    assert ck.unreadable_reason(flat).startswith("the file is a zip archive but not a torch checkpoint (no FOLDER/")
    good = tmp_path / "good.ckpt"
    torch.save({"a": 1}, good)
    assert ck.unreadable_reason(good) is None
    with pytest.raises(ck.CheckpointError, match=r"cannot read checkpoint .*empty.ckpt: the file is empty \(0 bytes\)"):
        ck.load_checkpoint(empty)


def test_fallback_advice_for_each_kind_of_neighbour(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    failed = folder / "last.ckpt"
    failed.write_bytes(b"garbage")
    assert ck.fallback_advice(failed) == f"No other checkpoint in {folder} can be read; start again: overwrite=true"
    torch.save({"format": "stabletrain.runfiles.checkpoint", "step": 2}, folder / "step_000002.ckpt")  # no health
    assert ck.fallback_advice(failed) == (
        f"The newest readable checkpoint is {folder / 'step_000002.ckpt'}, step 2 (health not recorded: written by an "
        f"older stabletrain); continue from it: resume_from={shell_path(folder / 'step_000002.ckpt')}")
    (folder / "step_000002.ckpt").unlink()
    torch.save(_state(4, False, "exploding"), folder / "step_000004.ckpt")
    assert ck.fallback_advice(failed, command=lambda **kw: json.dumps(kw, default=str)) == (
        f"No other checkpoint in {folder} is healthy (the newest, {folder / 'step_000004.ckpt'}, is step 4 (not "
        f'healthy: exploding)); start again: {{"overwrite": true}}')
    torch.save(_state(3, True), folder / "step_000003.ckpt")
    best = ck.fallback_checkpoint(failed)
    assert best is not None and (best.step, best.healthy, best.reason()) == (3, True, "step 3 (healthy: fine)")


def test_list_checkpoints_prefers_the_periodic_file_and_skips_unreadable_ones(tmp_path):
    out = tmp_path / "run"
    for step in (2, 4):
        ck.save_checkpoint(_state(step, step == 2, "why" if step == 4 else "fine"), out, periodic=True, keep=5)
    folder = out / "checkpoints"
    (folder / "step_000009.ckpt").write_bytes(b"torn")
    (folder / "notes.txt").write_text("x")
    infos = ck.list_checkpoints(folder)
    assert [(c.step, c.path.name, c.healthy, c.why) for c in infos] == [
        (2, "step_000002.ckpt", True, "fine"), (4, "step_000004.ckpt", False, "why")]
    assert ck.list_checkpoints(tmp_path / "none") == []
    ck.save_checkpoint(_state(6, None), out, periodic=False, keep=5)  # last.ckpt alone holds step 6
    infos = ck.list_checkpoints(folder)
    assert [(c.step, c.path.name, c.healthy) for c in infos][-1] == (6, "last.ckpt", None)
    assert infos[-1].reason() == "step 6 (health not recorded: written by an older stabletrain)"
    assert [c.step for c in infos] == [2, 4, 6]
    assert ck.newest_healthy(folder).step == 2 and ck.newest_healthy(folder, before_step=1) is None
    ck.save_checkpoint(_state(8, True), out, periodic=True, keep=5)
    assert ck.newest_healthy(folder).step == 8 and ck.newest_healthy(folder, before_step=7).step == 2
    with pytest.raises(ValueError, match="is not a stabletrain checkpoint"):
        torch.save({"a": 1}, tmp_path / "x.ckpt")
        ck.read_checkpoint_health(tmp_path / "x.ckpt")


def test_resume_conflicts_name_each_frozen_setting_that_changed():
    saved = {"task": "language_model", "batch_size": 8, "model_args": {"dim": 32}, "seed": 0}
    now = {"task": "language_model", "batch_size": 16, "model_args": {"dim": 32, "qk_norm": False}, "seed": 0}
    assert ck.resume_conflicts(saved, now) == [
        "batch_size: the checkpoint was trained with 8, now 16; this setting cannot change on resume (start a new run "
        "in another out folder instead)"]
    now2 = {**saved, "model_args": {"dim": 32, "qk_norm": True}}
    assert ck.resume_conflicts(saved, now2) == [
        "model_args.qk_norm: the checkpoint was trained with false, now true; this setting cannot change on resume "
        "(start a new run in another out folder instead)"]
    assert ck.resume_conflicts({**saved, "model_args": 3}, saved)[0].startswith(
        "model_args.dim: the checkpoint was trained with null, now 32")


# ------------------------------------------------------------------------------------------------
# Edges found by mutation testing (scripts/mutation_test.py checkpoint)
# ------------------------------------------------------------------------------------------------


def test_not_enough_space_says_how_much_in_mib(tmp_path):
    err = ck.NotEnoughSpaceError(tmp_path / "last.ckpt", needed=3 * 2**20, free=2**20 + 2**19)
    assert err.errno == errno.ENOSPC and (err.needed, err.free) == (3 * 2**20, 2**20 + 2**19)
    assert "(3.0 MiB needed, 1.5 MiB free)" in str(err)


def test_an_exception_is_told_by_its_type_and_first_line():
    assert ck._exception_text(EOFError()) == "EOFError"
    assert ck._exception_text(ValueError("\n  the first line  \nthe second")) == "ValueError: the first line"


def test_settings_allowed_to_differ_do_not_stop_the_others_being_checked():
    saved = {k: 1 for k in ck.FROZEN_ON_RESUME if "." not in k}
    current = dict(saved, task=2, seed=3)
    keys = [p.split(":")[0] for p in ck.resume_conflicts(saved, current, allow=("task",))]
    assert "seed" in keys and "task" not in keys, keys
    assert "task" in [p.split(":")[0] for p in ck.resume_conflicts(saved, current)]


def test_unreadable_files_and_duplicate_steps_do_not_hide_later_checkpoints(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "step_000001.ckpt").write_bytes(b"not a checkpoint")  # unreadable: skipped
    torch.save(_state(2), folder / "step_000002.ckpt")
    torch.save(_state(2), folder / "last.ckpt")  # the same step as step_000002: listed once
    torch.save(_state(4), folder / "step_000004.ckpt")
    infos = ck.list_checkpoints(folder)
    assert [(c.step, c.path.name) for c in infos] == [(2, "step_000002.ckpt"), (4, "step_000004.ckpt")]
    assert ck.newest_healthy(folder, before_step=4).step == 4, "at most before_step steps: 4 included"
    assert ck.newest_healthy(folder, before_step=3).step == 2


def test_what_looks_like_a_sharded_checkpoint_folder(tmp_path):
    named = tmp_path / "step_000010.ckpt"
    named.mkdir()
    with_meta = tmp_path / "a"
    with_meta.mkdir()
    (with_meta / ck.META_NAME).write_bytes(b"")
    with_index = tmp_path / "b"
    with_index.mkdir()
    (with_index / ck.DCP_INDEX).write_bytes(b"")
    plain = tmp_path / "run"
    plain.mkdir()
    assert [ck._looks_sharded(p) for p in (named, with_meta, with_index, plain)] == [True, True, True, False]
    assert ck.resolve_checkpoint(plain) == plain / "last.ckpt"
    assert ck.resolve_checkpoint(with_index) == with_index


def test_a_full_checkpoint_is_copied_over_a_sharded_folder_of_the_same_name(tmp_path):
    """The newest healthy checkpoint kept under its periodic name when a sharded folder holds that name
    (a run that went from sharded to full checkpoints): the folder is replaced by the file's bytes,
    through a temporary that does not stay, and the source is left as it was."""
    src = tmp_path / "last.ckpt"
    src.write_bytes(b"the full checkpoint")
    dst = tmp_path / "step_000004.ckpt"
    dst.mkdir()
    (dst / "meta.pt").write_text("an older sharded checkpoint")
    ck._atomic_copy(src, dst)
    assert dst.is_file() and dst.read_bytes() == b"the full checkpoint"
    assert src.read_bytes() == b"the full checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step_000004.ckpt"], "no temporary left"


def _written(out, *states):
    """Checkpoint files written without rotation; returns their folder."""
    for state in states:
        ck.save_checkpoint(state, out, periodic=True, keep=100)
    return out / "checkpoints"


def _pending(step: int, since: int) -> dict:
    state = _state(step)
    state["health"]["pending_since"] = since
    return state


@pytest.mark.parametrize("case, kept", [
    ("newest unhealthy", [4, 6]),        # the newest healthy one (4) stays, not the second file's health
    ("pending at 3", [2, 6]),            # the newest's pending rule: the healthy one from before step 3
    ("pending at 4", [4, 6]),            # ... at most 4 steps: step 4's file itself
])
def test_rotation_reads_the_newest_checkpoints_health(tmp_path, case, kept):
    """Rotation (keep=1) judged by the newest checkpoint: its health, and its pending mechanism rule."""
    newest = {"newest unhealthy": _state(6, False, "exploding"), "pending at 3": _pending(6, 3),
              "pending at 4": _pending(6, 4)}[case]
    folder = _written(tmp_path / "run", _state(2), _state(4), newest)
    ck._prune(folder, keep=1)
    assert sorted(int(p.name[5:11]) for p in folder.glob("step_*.ckpt")) == kept


def test_a_second_file_of_the_same_step_is_listed_once_and_the_listing_goes_on(tmp_path):
    folder = _written(tmp_path / "run", _state(4), _state(6))
    (folder / "step_000002.ckpt").write_bytes((folder / "step_000004.ckpt").read_bytes())  # a copy: step 4 too
    infos = ck.list_checkpoints(folder)
    assert [(c.step, c.path.name) for c in infos] == [(4, "step_000002.ckpt"), (6, "step_000006.ckpt")]


def test_rotation_and_listing_pass_over_files_that_are_no_checkpoint(tmp_path):
    folder = _written(tmp_path / "run", _state(4))
    (folder / "step_000002.ckpt").mkdir()  # an incomplete sharded folder: not a checkpoint
    assert [c.step for c in ck.list_checkpoints(folder)] == [4], "the listing goes on past it"
    (folder / "step_000001.ckpt").write_bytes(b"not a torch file")  # unreadable: not listed
    (folder / "last.ckpt").unlink()
    (folder / "step_000004.ckpt").write_bytes(b"torn")
    assert ck.list_checkpoints(folder) == []
    ck._prune(folder, keep=0)  # nothing readable: nothing to protect, and no error
    assert sorted(p.name for p in folder.iterdir()) == ["step_000002.ckpt"]


def test_a_file_and_a_folder_replace_each_other(tmp_path):
    folder = tmp_path / "src_folder"
    folder.mkdir()
    (folder / "x").write_text("shards")
    dst = tmp_path / "last.ckpt"
    dst.write_text("a full file")
    ck._replace(folder, dst)  # a sharded checkpoint replaces a full file
    assert dst.is_dir() and (dst / "x").read_text() == "shards"
    src = tmp_path / "new_file"
    src.write_text("a full file again")
    ck._replace(src, dst)  # and a full file replaces the folder
    assert dst.is_file() and dst.read_text() == "a full file again" and not src.exists()
    other = tmp_path / "other"
    other.write_text("newer")
    ck._replace(other, dst)  # a file over a file
    assert dst.read_text() == "newer" and not other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"], "nothing left behind (no .old)"


def test_link_tree_links_meta_last_and_copies_where_links_fail(tmp_path, monkeypatch):
    import os

    src = tmp_path / "src"
    src.mkdir()
    # "rng.bin" sorts after meta.pt by name: meta.pt is still linked last.
    for name in (ck.META_NAME, "__0_0.distcp", "__1_0.distcp", ck.DCP_INDEX, "rng.bin"):
        (src / name).write_text(name)
    order = []
    real_link = os.link
    monkeypatch.setattr(os, "link", lambda a, b: (order.append(os.path.basename(b)), real_link(a, b))[1])
    dst = ck.link_tree(src, tmp_path / "deep" / "dst")
    assert order[-1] == ck.META_NAME and sorted(order) == sorted(p.name for p in src.iterdir())
    assert os.stat(dst / "__0_0.distcp").st_ino == os.stat(src / "__0_0.distcp").st_ino, "a hard link"

    def no_links(a, b):
        raise OSError(errno.EXDEV, "cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    copy = ck.link_tree(src, tmp_path / "copy")
    assert {p.name: p.read_text() for p in copy.iterdir()} == {p.name: p.read_text() for p in src.iterdir()}
    assert os.stat(copy / "__0_0.distcp").st_ino != os.stat(src / "__0_0.distcp").st_ino, "a copy"


def test_a_sharded_checkpoint_checks_every_rank_s_bytes_once_in_a_new_run_folder(tmp_path, monkeypatch):
    from stabletrain.utils import io

    out = tmp_path / "deep" / "run"  # nothing exists yet
    nbytes = 3_000_000  # every rank's shards together; the meta itself holds no tensors
    needed = int(nbytes * 1.05) + 2**16  # once: last.ckpt of a periodic folder is hard links
    monkeypatch.setattr(io, "free_bytes", lambda folder: needed - 1)
    with pytest.raises(ck.NotEnoughSpaceError) as info:
        ck.begin_sharded({"step": 8}, out, periodic=True, nbytes=nbytes)
    assert info.value.needed == needed and info.value.filename == str(out / "checkpoints" / "step_000008.ckpt")
    monkeypatch.setattr(io, "free_bytes", lambda folder: needed)
    tmp = ck.begin_sharded({"step": 8}, out, periodic=True, nbytes=nbytes)
    assert tmp == out / "checkpoints" / ".step_000008.ckpt.tmp" and tmp.is_dir() and not any(tmp.iterdir())


def test_an_unhealthy_sharded_checkpoint_keeps_the_only_copy_of_the_newest_healthy_one(tmp_path):
    out = tmp_path / "run"
    ck.save_checkpoint(_state(4), out, periodic=False, keep=1)  # last.ckpt: the only copy of step 4
    meta = {"step": 6, "health": {"healthy": False, "why": "loss is exploding"}}
    tmp = ck.begin_sharded(meta, out, periodic=False, nbytes=10)
    (tmp / "__0_0.distcp").write_bytes(b"shard")
    (tmp / ck.DCP_INDEX).write_bytes(b"index")
    last = ck.commit_sharded(meta, out, periodic=False, keep=1)
    folder = out / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step_000004.ckpt"]
    assert ck.read_checkpoint_health(folder / "step_000004.ckpt") == (4, {"healthy": True, "why": "fine"})
    written = ck.read_sharded_meta(last)
    assert (written["format"], written["version"], written["step"]) == (ck.FORMAT, ck.VERSION, 6)
    assert written["layout"] == "sharded"
    assert written["files"] == {"__0_0.distcp": 5, ck.DCP_INDEX: 5}
    saved_at = datetime.datetime.fromisoformat(written["saved_at"])
    assert saved_at.utcoffset() == datetime.timedelta(0), "saved_at is in UTC"


def test_a_sharded_meta_that_cannot_be_read_or_is_not_ours_is_refused(tmp_path):
    out = tmp_path / "run"
    meta = {"step": 2}
    tmp = ck.begin_sharded(meta, out, periodic=False, nbytes=10)
    (tmp / "__0_0.distcp").write_bytes(b"shard")
    (tmp / ck.DCP_INDEX).write_bytes(b"index")
    last = ck.commit_sharded(meta, out, periodic=False, keep=1)
    assert ck.read_sharded_meta(last)["step"] == 2
    torch.save(["not", "a", "dict"], last / ck.META_NAME)
    with pytest.raises(ck.CheckpointError, match=r"is not a stabletrain checkpoint"):
        ck.read_sharded_meta(last)
    torch.save({"format": "someone else's", "step": 2}, last / ck.META_NAME)
    with pytest.raises(ck.CheckpointError, match=r"is not a stabletrain checkpoint"):
        ck.read_sharded_meta(last)
    torch.save({"format": ck.FORMAT, "step": 2, "x": _Payload()}, last / ck.META_NAME)
    with pytest.raises(ck.CheckpointError, match=r"cannot read checkpoint .*last\.ckpt: UnpicklingError: \S.*\. "):
        ck.read_sharded_meta(last)
    assert _Payload.unpickled == 0


class _Payload:
    """An arbitrary Python object in a checkpoint file: reading its health must not unpickle it."""

    unpickled = 0

    def __reduce__(self):
        return (_Payload._make, ())

    @staticmethod
    def _make():
        _Payload.unpickled += 1
        return _Payload()


def test_reading_a_checkpoint_s_health_never_unpickles_arbitrary_objects(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"step": 3, "health": {"healthy": True, "why": "fine"}, "x": _Payload()}, folder / "step_000003.ckpt")
    torch.save(_state(5), folder / "step_000005.ckpt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        ck.read_checkpoint_health(folder / "step_000003.ckpt")
    assert [c.step for c in ck.list_checkpoints(folder)] == [5], "the file with a foreign object is skipped"
    assert _Payload.unpickled == 0


def test_removing_a_folder_never_raises(tmp_path, monkeypatch):
    """A temporary that cannot be removed (permissions, a busy network share) must not fail the run."""
    import shutil

    def rmtree(path, ignore_errors=False, **kw):
        if not ignore_errors:
            raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    folder = tmp_path / ".last.ckpt.tmp"
    folder.mkdir()
    ck._remove(folder)


def test_a_pending_mechanism_keeps_the_newest_healthy_checkpoint_from_before_its_step(tmp_path):
    out = tmp_path / "run"
    folder = out / "checkpoints"
    ck.save_checkpoint(_state(2), out, periodic=True, keep=5)  # step_000002.ckpt and last.ckpt
    ck.save_checkpoint(_state(4), out, periodic=False, keep=5)  # last.ckpt: the only copy of step 4
    pending = _state(6)
    pending["health"]["pending_since"] = 3  # a mechanism may be named that began at step 3
    ck.save_checkpoint(pending, out, periodic=False, keep=5)
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step_000002.ckpt"], (
        "step 2 (before step 3) is kept already; step 4 is not copied")
    # With nothing healthy at all, an unhealthy checkpoint is written and nothing is copied.
    fresh = tmp_path / "fresh"
    ck.save_checkpoint(_state(1, healthy=False, why="exploding"), fresh, periodic=False, keep=5)
    assert sorted(p.name for p in (fresh / "checkpoints").iterdir()) == ["last.ckpt"]


def test_two_checkpoints_of_the_same_size_and_time_are_not_confused(tmp_path):
    import os

    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    torch.save(_state(10), a)
    torch.save(_state(20), b)
    assert a.stat().st_size == b.stat().st_size
    os.utime(b, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns))
    assert ck.read_checkpoint_health(a)[0] == 10 and ck.read_checkpoint_health(b)[0] == 20


def test_small_readers_of_checkpoint_files(tmp_path):
    assert ck.checkpoint_size(tmp_path / "missing.ckpt") == 0
    newer = tmp_path / "newer.ckpt"
    torch.save({**_state(1), "format": ck.FORMAT, "version": ck.VERSION + 1}, newer)
    with pytest.raises(ck.CheckpointError) as info:
        ck.load_checkpoint(newer)
    assert str(info.value) == (f"{newer} was written by a newer stabletrain (checkpoint format {ck.VERSION + 1}, "
                               f"this version reads up to {ck.VERSION}); upgrade stabletrain")
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"step": 2, "health": {"healthy": True}}, folder / "step_000002.ckpt")  # no "why" recorded
    assert [(c.step, c.healthy, c.why) for c in ck.list_checkpoints(folder)] == [(2, True, "")]


def test_removing_temporaries_never_raises(tmp_path, monkeypatch):
    import shutil

    def rmtree(path, ignore_errors=False, **kw):
        if not ignore_errors:
            raise PermissionError(13, "Permission denied", str(path))

    out = tmp_path / "run"
    (out / "checkpoints" / ".step_000004.ckpt.tmp").mkdir(parents=True)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    assert [p.name for p in ck.remove_temporaries(out)] == [".step_000004.ckpt.tmp"]


def test_remove_temporaries_puts_back_an_interrupted_replacement_or_drops_what_it_replaced(tmp_path):
    out = tmp_path / "run"
    folder = out / "checkpoints"
    ck.save_checkpoint(_state(4), out, periodic=False, keep=1)
    # Killed after the new last.ckpt landed, before the one it replaced was removed: the new one stays.
    torch.save(_state(2), folder / ".last.ckpt.old")
    # A sharded writer killed mid-write: its temporary folder, with a shard in it.
    (folder / ".step_000006.ckpt.tmp").mkdir()
    (folder / ".step_000006.ckpt.tmp" / "__0_0.distcp").write_bytes(b"shard")
    removed = ck.remove_temporaries(out)
    assert sorted(removed) == [folder / ".last.ckpt.old", folder / ".step_000006.ckpt.tmp"]
    assert _names(folder) == ["last.ckpt"] and ck.load_checkpoint(folder / "last.ckpt")["step"] == 4
    # Killed between the two renames: the old file is the only checkpoint, and it is put back.
    (folder / "last.ckpt").rename(folder / ".last.ckpt.old")
    assert ck.remove_temporaries(out) == []
    assert _names(folder) == ["last.ckpt"] and ck.load_checkpoint(folder / "last.ckpt")["step"] == 4


def _fake_sharded(out, step: int):
    """A committed sharded checkpoint folder whose shard and index are not DCP's: its meta reads,
    its tensors do not."""
    meta = {"step": step}
    tmp = ck.begin_sharded(meta, out, periodic=False, nbytes=10)
    (tmp / "__0_0.distcp").write_bytes(b"shard")
    (tmp / ck.DCP_INDEX).write_bytes(b"index")
    return ck.commit_sharded(meta, out, periodic=False, keep=1)


def test_a_sharded_checkpoint_with_damaged_shards_or_from_a_newer_version_is_refused_by_name(tmp_path):
    last = _fake_sharded(tmp_path / "run", 2)
    assert ck.load_checkpoint(last, tensors=False)["step"] == 2
    with pytest.raises(ck.CheckpointError) as info:
        ck.load_checkpoint(last)
    assert str(info.value) == (f"cannot read checkpoint {last}: UnpicklingError: could not find MARK. "
                               f"No other checkpoint in {last.parent} can be read; start again: overwrite=true")
    torch.save({**ck.read_sharded_meta(last), "version": ck.VERSION + 1}, last / ck.META_NAME)
    with pytest.raises(ck.CheckpointError) as info:
        ck.load_checkpoint(last, tensors=False)
    assert str(info.value) == (f"{last} was written by a newer stabletrain (checkpoint format {ck.VERSION + 1}, "
                               f"this version reads up to {ck.VERSION}); upgrade stabletrain")


def test_a_checkpoint_file_holding_a_foreign_object_is_refused_with_torch_s_reason(tmp_path):
    path = tmp_path / "last.ckpt"
    torch.save({**_state(3), "format": ck.FORMAT, "x": _Payload()}, path)
    assert ck.unreadable_reason(path) is None, "whole on disk: the reason is torch's"
    with pytest.raises(ck.CheckpointError) as info:
        ck.load_checkpoint(path)
    text = str(info.value)  # the object torch names depends on how it pickles (here getattr)
    assert text.startswith(f"cannot read checkpoint {path}: UnpicklingError: Weights only load failed: Unsupported "
                           "global: GLOBAL ")
    assert text.endswith(" was not an allowed global by default. "
                         f"No other checkpoint in {tmp_path} can be read; start again: overwrite=true"), text
    assert _Payload.unpickled == 0


def test_exception_text_is_one_plain_clause():
    assert ck._exception_text(EOFError()) == "EOFError"
    assert ck._exception_text(ValueError("\n  bad header.\nmore detail")) == "ValueError: bad header"
    assert ck._exception_text(OSError("\x1b[1mbold\x1b[0m text")) == "OSError: bold text"
    assert ck._exception_text(ValueError("no column X.")) == "ValueError: no column X", "only full stops go"


def test_why_a_sharded_folder_cannot_be_read(tmp_path):
    empty = tmp_path / "step_000004.ckpt"
    empty.mkdir()
    assert ck.unreadable_reason(empty) == ("the folder holds no meta.pt, which a sharded checkpoint gets last: its write "
                                           "did not finish, or it is not a checkpoint")
    last = _fake_sharded(tmp_path / "run", 2)
    assert ck.unreadable_reason(last) is None
    (last / ck.META_NAME).write_bytes(b"")
    assert ck.unreadable_reason(last) == "meta.pt: the file is empty (0 bytes)"
