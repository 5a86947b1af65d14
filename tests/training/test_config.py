"""Settings: one definition, two front ends, every mistake reported at once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import BaseModel

from conftest import tiny_lm
from stabletrain.config import TrainSettings, load_settings, parse_cli_overrides, settings_help
from stabletrain.errors import ConfigError
from stabletrain.training.loop import train


def _all_dotted(model: type[BaseModel] = TrainSettings, prefix: str = "") -> list[str]:
    names = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            names += _all_dotted(ann, prefix + name + ".")
        else:
            names.append(prefix + name)
    return names


def test_cli_keys_map_one_to_one_onto_python_settings():
    from_cli = load_settings(
        parse_cli_overrides(
            [
                "out=out/x",
                "model_args.lr=0.01",
                "precision=bf16-mixed",
                "debug_args.underflow_overflow.enabled=true",
                "debug_args.underflow_overflow.trace_batch_nums=[3,1]",
                "devices=2",
                "transform_args.normalize.mean=[0.5,0.5,0.5]",
                "torch_compile_args.mode=null",
            ]
        )
    )
    from_python = TrainSettings(
        out="out/x",
        model_args={"lr": 0.01},
        precision="bf16-mixed",
        debug_args={"underflow_overflow": {"enabled": True, "trace_batch_nums": [1, 3]}},
        devices=2,
        transform_args={"normalize": {"mean": (0.5, 0.5, 0.5)}},
    )
    assert from_cli == from_python
    assert from_cli.model_args.lr == 0.01 and from_cli.out == Path("out/x")


def test_help_lists_every_setting_with_type_default_and_description(cli):
    result = cli("train", "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for name in _all_dotted():
        if name == "callbacks":  # Python only
            continue
        assert f"  {name}  (" in text, name
    assert "  model_args.lr  (float, default 0.001)" in text
    assert "  precision  (auto|32-true|bf16-mixed|16-mixed|bf16-true|16-true|64-true, default \"auto\")" in text
    rows = settings_help()
    assert all(desc for name, _, _, desc in rows if not name.startswith("loggers.") or name.endswith("enabled")), [
        r for r in rows if not r[3]
    ]


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"setps": 3}, "setps: unknown setting. Did you mean 'steps'?"),
        ({"model_args": {"lrr": 3}}, "model_args.lrr: unknown setting. Did you mean 'model_args.lr'?"),
        ({"debug_args": {"nancapture": {"enable": True}}}, "Did you mean 'debug_args.nancapture.enabled'?"),
        ({"steps": "many"}, "steps: Input should be a valid integer"),
        ({"model_args": {"lr": -1}}, "model_args.lr: Input should be greater than 0 (got -1)"),
        ({"precision": "fp8"}, "precision: Input should be 'auto', '32-true', 'bf16-mixed'"),
        ({"gradient_clip_val": -0.5}, "gradient_clip_val: Input should be greater than or equal to 0 (got -0.5)"),
        ({"debug_args": {"underflow_overflow": {"max_frames_to_save": 0}}}, "max_frames_to_save: Input should be greater than or equal to 1"),
        ({"debug_args": {"underflow_overflow": {"trace_batch_nums": [2, -1]}}}, "step numbers must be >= 0, got [-1]"),
        ({"num_workers": -2}, "num_workers"),
    ],
)
def test_bad_values_name_setting_value_and_valid_range(settings, expected):
    with pytest.raises(ConfigError) as info:
        load_settings({"out": "o", **settings})
    assert expected in str(info.value)


def test_several_mistakes_are_listed_at_once():
    with pytest.raises(ConfigError) as info:
        load_settings({"out": "o", "steps": 0, "model_args": {"lr": 0, "wd": 1}, "precision": "fp4"})
    assert len(info.value.problems) == 4
    assert str(info.value).startswith("Invalid settings (4 problems):")


def test_cli_values_are_parsed_as_json_else_strings():
    parsed = parse_cli_overrides(["a=1", "b=1.5", "c=true", "d=null", "e=[1,2]", "f=bf16-mixed", "g.h=x"])
    assert parsed == {"a": 1, "b": 1.5, "c": True, "d": None, "e": [1, 2], "f": "bf16-mixed", "g": {"h": "x"}}
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_cli_overrides(["model_args.lr"])
    with pytest.raises(ConfigError, match="cannot also have sub-keys"):
        parse_cli_overrides(["model_args=1", "model_args.lr=2"])


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"data": "missing.txt"}, "data: file not found"),
        ({"model": "torchvision/resnet1008"}, "model:"),
        ({"model": "transfomer"}, "model:"),
        ({"batch_size": 10, "gradient_accumulation_steps": 4}, "batch_size: 10 is not divisible"),
        ({"model_args": {"cnn_width": 8}}, "model_args.cnn_width: not used by the language_model task"),
    ],
)
def test_semantic_mistakes_fail_before_training(tmp_path, overrides, expected):
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        train(out=out, **tiny_lm(**overrides))
    assert expected in str(info.value)
    assert not out.exists(), "nothing may be written for a configuration mistake"


def test_empty_dataset_fails_before_training(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ConfigError, match="data:"):
        train(out=tmp_path / "run", **tiny_lm(data=str(empty)))
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(ConfigError, match="data:"):
        train(out=tmp_path / "run", **tiny_lm(data=str(short)))


class _Sized(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.full((2,), float(i)), "y": torch.zeros(1)}


class _Mean(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def training_step(self, batch):
        return torch.nn.functional.mse_loss(self.lin(batch["x"]), batch["y"])


def test_dataset_smaller_than_a_batch_fails_before_out_is_written(tmp_path):
    # The audit's case: 201 bytes are 3 windows of 64 + 1 tokens, the default batch_size is 32.
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(32, 127)) * 2 + b"abcdefghijk")
    assert text.stat().st_size == 201
    out = tmp_path / "o"
    with pytest.raises(ConfigError) as info:
        train(out=out, data=str(text))
    [problem] = info.value.problems
    assert problem.startswith(f"data: {text} holds 3 samples")
    assert "batch_size=32" in problem and "lower batch_size to 3 or less, or give more data" in problem
    assert not out.exists(), "nothing may be written for a configuration mistake"
    out.mkdir()
    with pytest.raises(ConfigError):
        train(out=out, data=str(text))
    assert not any(out.iterdir()), "an empty out/ stays empty"
    # The advice works, in the same out/ (no 'out is not empty' on the rerun).
    result = train(out=out, data=str(text), batch_size=3, steps=1)
    assert result.steps_done == 1


@pytest.mark.parametrize(
    "batch_size, accum, world_size",
    [(8, 1, 1), (8, 2, 1), (8, 1, 2), (12, 3, 2), (6, 2, 3)],
)
def test_dataset_size_check_matches_the_loader_exactly(tmp_path, batch_size, accum, world_size):
    from stabletrain.data.loader import ResumableBatchSampler
    from stabletrain.training.loop import Trainer

    microbatch = batch_size // (world_size * accum)
    for n in range(1, 2 * batch_size):
        try:
            ResumableBatchSampler(n, microbatch, seed=0, rank=0, world_size=world_size)
            loader_ok = True
        except ValueError:
            loader_ok = False
        settings = load_settings(
            {"out": tmp_path / "o", "model": _Mean(), "data": _Sized(n), "batch_size": batch_size,
             "gradient_accumulation_steps": accum}
        )
        problems = Trainer(settings)._check_dataset_size(world_size)
        assert (not problems) == loader_ok, (n, problems)
        if problems:
            assert f"holds {n} samples" in problems[0] and f"batch_size={batch_size}" in problems[0]
            if n >= world_size:
                largest = int(problems[0].split("lower batch_size to ")[1].split()[0])
                assert largest % (world_size * accum) == 0
                ResumableBatchSampler(n, largest // (world_size * accum), seed=0, rank=0, world_size=world_size)
            if world_size > 1:
                assert f"{world_size} x {accum}" in problems[0]


def test_custom_dataset_at_the_size_limit_trains(tmp_path):
    with pytest.raises(ConfigError, match=r"data: the dataset \(_Sized\) holds 7 samples"):
        train(out=tmp_path / "a", model=_Mean(), data=_Sized(7), batch_size=8, steps=1)
    assert not (tmp_path / "a").exists()
    assert train(out=tmp_path / "b", model=_Mean(), data=_Sized(8), batch_size=8, steps=2).steps_done == 2


def test_pydantic_fabric_data_and_out_mistakes_are_listed_at_once(tmp_path):
    out = tmp_path / "o"
    with pytest.raises(ConfigError) as info:
        train(out=out, steps=0, data="missing.txt", strategy="dpp")
    problems = info.value.problems
    assert len(problems) == 3, problems
    assert problems[0] == "steps: Input should be greater than or equal to 1 (got 0)"
    assert problems[1].startswith("strategy: not a Lightning Fabric strategy; did you mean 'dp' or 'ddp'? Valid choices: auto, ddp,")
    assert problems[1].endswith("(got 'dpp')")
    assert problems[2].startswith("data: file not found: missing.txt")
    assert not out.exists()

    # A non-empty out/ and a wrong accelerator name join pydantic's problems too.
    out.mkdir()
    (out / "x").write_text("x")
    with pytest.raises(ConfigError) as info:
        train(out=out, accelerator="cdua", model_args={"lr": -1}, data="missing.txt")
    text = str(info.value)
    assert text.startswith("Invalid settings (4 problems):")
    assert "accelerator: not a Lightning Fabric accelerator; did you mean 'cuda'? Valid choices: auto, cpu, cuda, gpu, mps, tpu (got 'cdua')" in text
    assert "model_args.lr: Input should be greater than 0 (got -1)" in text
    assert "data: file not found: missing.txt" in text
    assert f"out: {out} is not empty" in text


def test_checks_that_read_a_rejected_setting_are_skipped(tmp_path):
    # context_length is rejected, so the task's data checks (which read it) cannot run;
    # the data path is still checked on its own.
    with pytest.raises(ConfigError) as info:
        train(out=tmp_path / "o", data="missing.txt", model_args={"context_length": 0})
    assert info.value.problems == [
        "model_args.context_length: Input should be greater than or equal to 2 (got 0)",
        "data: not found: missing.txt",
    ]
    text = tmp_path / "t.txt"
    text.write_text("short")
    with pytest.raises(ConfigError) as info:
        train(out=tmp_path / "o", data=str(text), model_args={"context_length": 1})
    assert len(info.value.problems) == 1, "no 'too short for context_length' from a rejected context_length"


@pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(), reason="needs a machine without a GPU")
def test_unavailable_accelerator_is_reported_with_other_problems(tmp_path):
    with pytest.raises(ConfigError) as info:
        train(out=tmp_path / "o", **tiny_lm(accelerator="gpu", data="missing.txt"))
    assert "accelerator: 'gpu' is not available on this machine; available here: auto, cpu" in info.value.problems
    assert any(p.startswith("data: file not found") for p in info.value.problems)
    assert not (tmp_path / "o").exists()


def test_semantic_and_task_mistakes_are_reported_together(tmp_path):
    with pytest.raises(ConfigError) as info:
        train(out=tmp_path / "run", **tiny_lm(data="nope.txt", batch_size=7, gradient_accumulation_steps=2))
    assert len(info.value.problems) >= 2
    assert any(p.startswith("data:") for p in info.value.problems)
    assert any(p.startswith("batch_size:") for p in info.value.problems)


def test_cli_config_error_exits_2_without_traceback(cli):
    result = cli("train", "out=o", "model_args.lrr=0.1", "steps=-1", "precision=fp8")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "Invalid settings (3 problems)" in result.stderr
    assert "Did you mean 'model_args.lr'?" in result.stderr
    missing_out = cli("train", "steps=3")
    assert missing_out.returncode == 2 and "out: required setting is missing" in missing_out.stderr


def test_cli_lists_pydantic_fabric_and_data_mistakes_at_once(cli):
    result = cli("train", "out=o", "steps=0", "data=missing.txt", "strategy=dpp")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "Invalid settings (3 problems)" in result.stderr
    assert "  - steps: Input should be greater than or equal to 1 (got 0)" in result.stderr
    assert "  - strategy: not a Lightning Fabric strategy" in result.stderr
    assert "  - data: file not found: missing.txt" in result.stderr


def test_resolved_settings_rebuild_the_same_settings(tmp_path):
    import json

    from stabletrain.config import settings_from_resolved

    out = tmp_path / "run"
    train(out=out, **tiny_lm(steps=1, model_args={"lr": 0.02}))
    resolved = json.loads((out / "settings.json").read_text())
    rebuilt = settings_from_resolved(resolved)
    assert rebuilt.model_args.lr == 0.02 and rebuilt.model_args.dim == 32
    assert rebuilt.task == "language_model" and rebuilt.precision == "32-true"
    assert settings_from_resolved(resolved, precision="bf16-mixed").precision == "bf16-mixed"


@pytest.mark.parametrize("name", ["fsdp", "FSDP2"])
def test_fsdp_names_mean_fsdp2(name):
    assert load_settings({"out": "o", "strategy": name}).strategy == name.lower()


def test_fsdp1_variants_are_refused_with_the_way_to_fsdp2():
    with pytest.raises(ConfigError) as info:
        load_settings({"out": "o", "strategy": "fsdp_cpu_offload"})
    (problem,) = info.value.problems
    assert problem.startswith("strategy: 'fsdp_cpu_offload' is one of Lightning Fabric's FSDP1 variants")
    assert "Use strategy=fsdp (FSDP2" in problem


def test_what_sharding_needs_is_checked_and_fsdp_takes_every_tool():
    """Compile, self-healing and 16-mixed run under fsdp (issue 22): no problem is reported for them; the
    sharded checkpoint settings without fsdp are refused (tests/training/test_sharded_checkpoints.py)."""
    from stabletrain.training.checks import sharding_problems

    fsdp = load_settings({"out": "o", "strategy": "fsdp", "torch_compile_args": {"disable": False},
                          "on_instability": {"policy": "rollback"}, "precision": "16-mixed",
                          "checkpoint_async": True})
    assert sharding_problems(fsdp) == []
    plain = load_settings({"out": "o", "checkpoint_format": "sharded"})
    assert [p.split(":")[0] for p in sharding_problems(plain)] == ["checkpoint_format"]
