"""The built-in tasks through the whole trainer."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from stabletrain.loggers.jsonl import read_metrics
from stabletrain.training.loop import train


def test_cnn_on_generated_images_learns(tmp_path):
    train(out=tmp_path / "run", model="cnn", steps=100, log_every_num_steps=1, model_args={"lr": 3e-3, "warmup_steps": 5})
    rows, _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    settings = json.loads((tmp_path / "run" / "settings.json").read_text())
    assert settings["task"] == "image_classification" and settings["model_meta"]["num_classes"] == 4


def test_torchvision_model_by_name_on_an_image_folder(tmp_path):
    g = torch.Generator().manual_seed(0)
    for cls, colour in (("cats", 0), ("dogs", 2)):
        folder = tmp_path / "images" / cls
        folder.mkdir(parents=True)
        for i in range(8):
            arr = (torch.rand(20, 24, 3, generator=g) * 80).to(torch.uint8)
            arr[..., colour] += 150
            Image.fromarray(arr.numpy()).save(folder / f"{i}.png")
    result = train(
        out=tmp_path / "run",
        model="torchvision/resnet18",
        data=str(tmp_path / "images"),
        steps=3,
        batch_size=8,
        log_every_num_steps=1,
        transform_args={"image_size": 32},
    )
    assert result.steps_done == 3
    settings = json.loads((tmp_path / "run" / "settings.json").read_text())
    assert settings["model_meta"]["classes"] == ["cats", "dogs"]
    rows, _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert all(r["gradient_norm"] > 0 for r in rows)


def test_char_level_language_model_on_a_text_file(tmp_path):
    text = tmp_path / "poem.txt"
    text.write_text("roses are red, violets are blue.\n" * 40)
    train(
        out=tmp_path / "run", data=str(text), steps=30, batch_size=8, log_every_num_steps=1,
        model_args={"tokenizer": "char", "n_layers": 1, "dim": 32, "n_heads": 2, "context_length": 16, "lr": 5e-3},
    )
    rows, _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    meta = json.loads((tmp_path / "run" / "settings.json").read_text())["model_meta"]
    assert meta["tokenizer"] == "char" and meta["vocab_size"] == len(set("roses are red, violets are blue.\n"))
    assert rows[-1]["loss"] < rows[0]["loss"] * 0.7


def test_unknown_torchvision_model_suggests_close_names(tmp_path):
    from stabletrain.errors import ConfigError

    with pytest.raises(ConfigError, match="resnet18"):
        train(out=tmp_path / "run", model="torchvision/resnet19")
