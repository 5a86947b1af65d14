"""The built-in image-classification task: checks, building, rebuilding and the models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import default_collate

from stabletrain.config import TrainSettings
from stabletrain.tasks import check_task, image_classification
from stabletrain.tasks.image_classification import SmallCNN, TorchvisionClassifier


def settings(tmp_path: Path, **kw: Any) -> TrainSettings:
    kw.setdefault("model", "cnn")
    return TrainSettings(out=tmp_path / "out", **kw)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def write_folder(root: Path, counts: dict[str, int], size: int = 12) -> Path:
    rng = np.random.default_rng(0)
    for cls, n in counts.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(root / cls / f"{i}.png")
    return root


# --------------------------------------------------------------------------------------
# build / build_model
# --------------------------------------------------------------------------------------


def test_build_default_generated_images(tmp_path: Path):
    task = image_classification.build(settings(tmp_path, model=None, transform_args={"image_size": 24}))
    assert task.name == "image_classification" and task.in_memory
    assert task.model_meta == {"num_classes": 4, "classes": ["disc", "square", "cross", "ring"]}
    assert len(task.dataset) == 2048
    x, y = task.dataset[0]
    assert x.shape == (3, 24, 24) and x.dtype == torch.float32
    assert y.shape == () and y.dtype == torch.long
    assert isinstance(task.model, SmallCNN)
    names = dict(task.model.named_modules())
    for name in ("features.0.conv", "features.0.bn", "features.2.conv", "head"):
        assert name in names, name
    assert task.model.head.out_features == 4
    assert task.model.features[0].conv.out_channels == 32


def test_build_and_build_model_give_identical_weights_for_the_seed(tmp_path: Path):
    s = settings(tmp_path, seed=3, model_args={"cnn_width": 8})
    task = image_classification.build(s)
    assert task.model.features[0].conv.out_channels == 8
    assert same_weights(task.model, image_classification.build_model(s, task.model_meta))
    other = image_classification.build_model(settings(tmp_path, seed=4, model_args={"cnn_width": 8}), task.model_meta)
    assert not same_weights(task.model, other)


def test_building_leaves_the_global_rng_alone(tmp_path: Path):
    torch.manual_seed(123)
    state = torch.get_rng_state()
    image_classification.build(settings(tmp_path))
    image_classification.check(settings(tmp_path, model="torchvision/resnet18"))
    assert torch.equal(state, torch.get_rng_state())


def test_build_from_folder(tmp_path: Path):
    root = write_folder(tmp_path / "data", {"zebra": 2, "ant": 3, "moth": 1})
    s = settings(tmp_path, data=str(root), transform_args={"image_size": 16})
    task = image_classification.build(s)
    assert not task.in_memory
    assert task.model_meta == {"num_classes": 3, "classes": ["ant", "moth", "zebra"]}
    assert len(task.dataset) == 6
    x, y = task.dataset[5]
    assert x.shape == (3, 16, 16) and int(y) == 2
    assert task.model.head.out_features == 3


def test_torchvision_resnet18_trains_one_step(tmp_path: Path):
    s = settings(tmp_path, model="torchvision/resnet18")
    model = image_classification.build_model(s, {"num_classes": 3, "classes": ["a", "b", "c"]})
    assert isinstance(model, TorchvisionClassifier)
    assert model.net.fc.out_features == 3
    assert "net.layer1.0.conv1" in dict(model.named_modules())
    batch = (torch.randn(2, 3, 32, 32), torch.tensor([0, 2]))
    loss = model.training_step(batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert model.net.conv1.weight.grad is not None and torch.isfinite(model.net.conv1.weight.grad).all()


def test_googlenet_aux_heads_get_gradients(tmp_path: Path):
    model = image_classification.build_model(settings(tmp_path, model="torchvision/googlenet"), {"num_classes": 2})
    model.train()
    model.training_step((torch.randn(2, 3, 64, 64), torch.tensor([0, 1]))).backward()
    assert model.net.aux1.fc2.weight.grad is not None and model.net.fc.weight.grad is not None


def test_a_few_steps_reduce_the_loss(tmp_path: Path):
    task = image_classification.build(settings(tmp_path, model_args={"cnn_width": 8, "dropout": 0.0}))
    model = task.model
    batch = default_collate([task.dataset[i] for i in range(32)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = model.training_step(batch).item()
    for _ in range(20):
        loss = model.training_step(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert model.training_step(batch).item() < 0.5 * first


# --------------------------------------------------------------------------------------
# check
# --------------------------------------------------------------------------------------


def test_check_accepts_defaults_and_a_good_folder(tmp_path: Path):
    assert image_classification.check(settings(tmp_path, model=None)) == []
    root = write_folder(tmp_path / "data", {"a": 1, "b": 1})
    assert image_classification.check(settings(tmp_path, data=str(root), model="torchvision/resnet18")) == []


def test_check_unknown_model_suggests_close_names(tmp_path: Path):
    (problem,) = image_classification.check(settings(tmp_path, model="torchvision/resnet81"))
    assert problem.startswith("model: unknown image model 'torchvision/resnet81'. Did you mean 'torchvision/resnet18'")
    assert "list_models(module=torchvision.models)" in problem and "'cnn'" in problem
    (problem,) = image_classification.check(settings(tmp_path, model="resnet18", task="image_classification"))
    assert "Did you mean 'torchvision/resnet18'" in problem


def test_check_model_that_rejects_the_image_size(tmp_path: Path):
    (problem,) = image_classification.check(settings(tmp_path, model="torchvision/vit_b_16"))
    assert problem.startswith("transform_args.image_size: torchvision/vit_b_16 does not accept 32x32 images")
    s = settings(tmp_path, model="torchvision/vit_b_16", transform_args={"image_size": 224})
    assert image_classification.check(s) == []


def test_check_missing_folder_and_file(tmp_path: Path):
    missing = tmp_path / "nope"
    (problem,) = image_classification.check(settings(tmp_path, data=str(missing)))
    assert problem.startswith(f"data: folder not found: {missing} (give a folder with one subfolder")
    file = tmp_path / "x.txt"
    file.write_text("hi")
    (problem,) = image_classification.check(settings(tmp_path, data=str(file)))
    assert problem.startswith(f"data: {file} is not a folder")


def test_check_folder_without_class_subfolders(tmp_path: Path):
    root = tmp_path / "flat"
    root.mkdir()
    Image.new("RGB", (8, 8)).save(root / "a.png")
    (problem,) = image_classification.check(settings(tmp_path, data=str(root)))
    assert problem.startswith(f"data: {root} has no class subfolders")
    assert "need to move into one subfolder per class" in problem


def test_check_folder_with_one_class_or_no_images(tmp_path: Path):
    one = write_folder(tmp_path / "one", {"only": 2})
    (problem,) = image_classification.check(settings(tmp_path, data=str(one)))
    assert "has 1 class subfolder ('only')" in problem and "at least 2 classes" in problem
    none = tmp_path / "none"
    (none / "a").mkdir(parents=True)
    (none / "b").mkdir()
    (none / "b" / "readme.txt").write_text("x")
    (problem,) = image_classification.check(settings(tmp_path, data=str(none)))
    assert problem.startswith(f"data: no images found in the class subfolders of {none}")
    assert ".jpg" in problem and ".png" in problem


def test_check_class_without_images(tmp_path: Path):
    root = write_folder(tmp_path / "data", {"a": 1, "b": 1})
    (root / "c").mkdir()
    (problem,) = image_classification.check(settings(tmp_path, data=str(root)))
    assert problem.startswith(f"data: class folders without images in {root}: 'c'")


def test_check_task_dispatches_here(tmp_path: Path):
    problems = check_task(settings(tmp_path, model="torchvision/resnet81", data=str(tmp_path / "nope")))
    assert [p.split(":")[0] for p in problems] == ["model", "data"]


def test_num_samples_is_the_built_datasets_length_and_too_few_fail(tmp_path: Path):
    from stabletrain.errors import ConfigError
    from stabletrain.training.loop import train

    folder = write_folder(tmp_path / "imgs", {"a": 3, "b": 2})
    for s in (settings(tmp_path), settings(tmp_path, data=str(folder))):
        assert image_classification.num_samples(s) == len(image_classification.build(s).dataset)
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        train(out=out, model="cnn", data=str(folder), batch_size=8, steps=1)
    assert info.value.problems == [
        (
            f"data: {folder} holds 5 samples, too few: one batch of batch_size=8 needs 8; "
            "lower batch_size to 5 or less, or give more data"
        )
    ]
    assert not out.exists()


# --------------------------------------------------------------------------------------
# Training accuracy (logged with the loss)
# --------------------------------------------------------------------------------------


def test_training_accuracy_counts_since_the_previous_read_against_float64():
    from stabletrain.tasks.image_classification import TrainingAccuracy

    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(n, 5, generator=g) for n in (7, 9, 4)]
    labels = [torch.randint(0, 5, (len(x),), generator=g) for x in logits]
    acc = TrainingAccuracy()
    assert acc.read() == {}
    for x, y in zip(logits[:2], labels[:2]):
        acc.update(x, y)
    hits = sum(int((x.numpy().argmax(1) == y.numpy()).sum()) for x, y in zip(logits[:2], labels[:2]))
    assert acc.read()["accuracy"].item() == hits / 16
    acc.update(logits[2], labels[2])  # a new window: only the last batch
    assert acc.read()["accuracy"].item() == float((logits[2].argmax(1) == labels[2]).double().mean())


def test_trainer_logs_the_accuracy_of_the_samples_since_the_previous_logged_step(tmp_path: Path):
    """Every microbatch's batch and weights are recorded; the logged accuracy must be the share of
    samples since the previous logged step that those weights (train mode) classify correctly."""
    import copy

    import stabletrain
    from stabletrain.loggers.jsonl import read_metrics

    seen: list[tuple[int, dict[str, torch.Tensor], Any]] = []

    class Record:
        def on_microbatch(self, trainer, *, step, micro_step, batch, indices):
            seen.append((step, copy.deepcopy(trainer.model.state_dict()), batch))

    out = tmp_path / "run"
    stabletrain.train(out=out, model="cnn", steps=5, batch_size=8, gradient_accumulation_steps=2, log_every_num_steps=2,
                      model_args={"cnn_width": 4, "dropout": 0.0, "lr": 0.05, "warmup_steps": 0}, callbacks=[Record()])
    rows, _ = read_metrics(out / "metrics.jsonl")
    logged = {r["step"]: r["accuracy"] for r in rows if "accuracy" in r}
    assert sorted(logged) == [0, 2, 4]

    model = SmallCNN(num_classes=4, width=4).train()
    hits = {0: 0, 2: 0, 4: 0}
    for step, state, (images, labels) in seen:
        model.load_state_dict(state)
        with torch.no_grad():
            correct = int((model(images).argmax(1) == labels).sum())
        hits[next(s for s in sorted(hits) if s >= step)] += correct
    samples = {0: 8, 2: 16, 4: 16}  # windows: step 0; steps 1-2; steps 3-4
    assert logged == {s: pytest.approx(hits[s] / samples[s], abs=1e-7) for s in hits}
    assert "acc " in (out / "train.log").read_text(), "the progress line shows it"


def test_accuracy_adds_no_host_sync(tmp_path: Path, monkeypatch):
    import stabletrain
    from stabletrain.utils.sync import SyncsPerStep

    def counts(name: str) -> dict[int, int]:
        counter = SyncsPerStep()
        stabletrain.train(out=tmp_path / name, model="cnn", steps=4, batch_size=8, log_every_num_steps=2,
                          model_args={"cnn_width": 4, "warmup_steps": 0}, callbacks=[counter])
        return counter.counts

    with_accuracy = counts("with")
    assert "accuracy" in (tmp_path / "with" / "metrics.jsonl").read_text()
    # Positive control: a metric read on the host is one more sync at each logged step (0, 2, 3).
    original = SmallCNN.training_metrics
    monkeypatch.setattr(SmallCNN, "training_metrics", lambda self: {"accuracy": torch.tensor(
        original(self)["accuracy"].item())})
    reading = counts("reading")
    monkeypatch.delattr(SmallCNN, "training_metrics")
    without = counts("without")
    assert "accuracy" not in (tmp_path / "without" / "metrics.jsonl").read_text()
    assert with_accuracy == without, (with_accuracy, without)
    assert reading == {s: n + (s in (0, 2, 3)) for s, n in without.items()}, (reading, without)
