"""Built-in image-classification task: the small ``cnn`` or any torchvision classifier.

Data is a folder with one subfolder per class, or generated shape images when ``data`` is omitted.
Models: ``"cnn"`` (:class:`SmallCNN`, the default) or ``"torchvision/<name>"``
(:class:`TorchvisionClassifier`, modules named under ``net.``). Initial weights depend only on
``settings.seed`` and the architecture. See docs/training.md.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from stabletrain.config import TrainSettings
from stabletrain.data.images import (
    IMAGE_EXTENSIONS,
    SHAPE_NAMES,
    ImageFolderDataset,
    ImageTransform,
    TensorImageDataset,
    find_bad_images,
    find_image_classes,
    generate_images,
)
from stabletrain.data.paths import IMAGE_DATA_HINT, data_path_problems
from stabletrain.tasks.base import Task
from stabletrain.utils.text import fmt_list

__all__ = [
    "SmallCNN",
    "TorchvisionClassifier",
    "TrainingAccuracy",
    "build",
    "build_model",
    "check",
    "torchvision_model_names",
]

#: Size, count and classes of the built-in generated dataset.
GENERATED_IMAGE_SIZE = 32
GENERATED_NUM_IMAGES = 2048
GENERATED_NUM_CLASSES = 4

_TORCHVISION_PREFIX = "torchvision/"
_LIST_COMMAND = (
    "python -c \"import torchvision; print(torchvision.models.list_models(module=torchvision.models))\""
)
_DATA_HINT = IMAGE_DATA_HINT
#: Unreadable files named in an error or a warning; the rest are counted.
_BAD_LISTED = 10


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------


class TrainingAccuracy:
    """Top-1 training accuracy, counted on the device in ``training_step`` and read by the
    trainer at logged steps (``training_metrics``): the fraction of the samples since the
    previous read that the model, in training mode and before that step's update, classified
    correctly. No host synchronisation: the sample count is known on the host.
    """

    def __init__(self) -> None:
        self.correct: torch.Tensor | None = None
        self.seen = 0

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        hits = (logits.detach().argmax(dim=-1) == labels).sum()
        self.correct = hits if self.correct is None else self.correct + hits
        self.seen += labels.numel()

    def read(self) -> dict[str, torch.Tensor]:
        """``{"accuracy": device scalar}`` since the previous read, then starts counting afresh."""
        if self.correct is None:
            return {}
        accuracy = self.correct.double() / self.seen
        self.correct, self.seen = None, 0
        return {"accuracy": accuracy}


class ConvBlock(nn.Module):
    """3x3 convolution -> BatchNorm -> ReLU -> 2x2 max-pool (halves height and width)."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.act(self.bn(self.conv(x))))


class SmallCNN(nn.Module):
    """Three conv blocks of width ``w``, ``2w``, ``4w``, global average pooling and a linear head.

    Args:
        num_classes: Number of output logits.
        width: Channels of the first block.
        dropout: Dropout before the head.

    Example::

        model = SmallCNN(num_classes=4, width=16)
        loss = model.training_step((torch.randn(8, 3, 32, 32), torch.randint(4, (8,))))
    """

    def __init__(self, num_classes: int, width: int = 32, dropout: float = 0.0):
        super().__init__()
        widths = (width, 2 * width, 4 * width)
        self.features = nn.Sequential(
            ConvBlock(3, widths[0]), ConvBlock(widths[0], widths[1]), ConvBlock(widths[1], widths[2])
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(widths[2], num_classes)
        self.accuracy = TrainingAccuracy()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, num_classes)`` for images ``(B, 3, H, W)``; H and W at least 8."""
        return self.head(self.drop(self.pool(self.features(images)).flatten(1)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy of an ``(images, labels)`` batch."""
        images, labels = batch
        logits = self(images)
        self.accuracy.update(logits, labels)
        return F.cross_entropy(logits.float(), labels)

    def training_metrics(self) -> dict[str, torch.Tensor]:
        """``accuracy`` since the previous call (:class:`TrainingAccuracy`)."""
        return self.accuracy.read()


#: Weight of auxiliary classifier losses (GoogLeNet, Inception v3), as in their papers.
AUX_LOSS_WEIGHT = 0.3


class TorchvisionClassifier(nn.Module):
    """A torchvision classification network held as ``net``, with ``training_step``.

    GoogLeNet and Inception v3 return auxiliary logits in training mode; their
    cross-entropy is added with weight :data:`AUX_LOSS_WEIGHT` so every parameter gets a
    gradient, as in the papers' training recipes.

    Args:
        net: A torchvision classifier returning logits (or a named tuple with ``logits``).
    """

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        self.accuracy = TrainingAccuracy()

    def forward(self, images: torch.Tensor) -> Any:
        return self.net(images)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy of an ``(images, labels)`` batch (plus weighted auxiliary losses)."""
        images, labels = batch
        out = self(images)
        if isinstance(out, torch.Tensor):
            self.accuracy.update(out, labels)
            return F.cross_entropy(out.float(), labels)
        # Named tuples: InceptionOutputs(logits, aux_logits), GoogLeNetOutputs(logits, aux_logits2, aux_logits1).
        outputs = out._asdict()
        logits = outputs.pop("logits")
        self.accuracy.update(logits, labels)
        loss = F.cross_entropy(logits.float(), labels)
        for aux in outputs.values():
            if aux is not None:
                loss = loss + AUX_LOSS_WEIGHT * F.cross_entropy(aux.float(), labels)
        return loss

    def training_metrics(self) -> dict[str, torch.Tensor]:
        """``accuracy`` since the previous call (:class:`TrainingAccuracy`), from the main logits."""
        return self.accuracy.read()


def torchvision_model_names() -> list[str]:
    """Classification models torchvision can build, e.g. ``["alexnet", ..., "resnet18", ...]``."""
    return sorted(torchvision.models.list_models(module=torchvision.models))


def _make_model(name: str, num_classes: int, settings: TrainSettings) -> nn.Module:
    if name == "cnn":
        return SmallCNN(num_classes, width=settings.model_args.cnn_width, dropout=settings.model_args.dropout)
    tv_name = name[len(_TORCHVISION_PREFIX) :]
    kwargs: dict[str, Any] = {}
    if tv_name in ("googlenet", "inception_v3"):
        # Explicit, to silence their FutureWarning about a changing default initialisation.
        kwargs["init_weights"] = True
    net = torchvision.models.get_model(tv_name, weights=None, num_classes=num_classes, **kwargs)
    return TorchvisionClassifier(net)


# --------------------------------------------------------------------------------------
# Settings checks
# --------------------------------------------------------------------------------------


def _model_name(settings: TrainSettings) -> str:
    return "cnn" if settings.model is None else str(settings.model)


def _check_model_name(name: str) -> list[str]:
    if name == "cnn":
        return []
    known = torchvision_model_names()
    if name.startswith(_TORCHVISION_PREFIX) and name[len(_TORCHVISION_PREFIX) :] in known:
        return []
    candidates = {"cnn": "cnn"}
    for n in known:
        # Match both the full name and the bare torchvision name ("resnet18" -> torchvision/resnet18).
        candidates[_TORCHVISION_PREFIX + n] = _TORCHVISION_PREFIX + n
        candidates[n] = _TORCHVISION_PREFIX + n
    bare = name[len(_TORCHVISION_PREFIX) :] if name.startswith(_TORCHVISION_PREFIX) else name
    matches = difflib.get_close_matches(name, list(candidates), n=5, cutoff=0.6)
    matches += difflib.get_close_matches(bare, list(candidates), n=5, cutoff=0.6)
    suggestions = list(dict.fromkeys(candidates[m] for m in matches))[:3]
    quoted = [repr(s) for s in suggestions]
    hint = ""
    if quoted:
        options = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
        hint = f"Did you mean {options}? "
    return [
        f"model: unknown image model {name!r}. {hint}Valid: 'cnn', or 'torchvision/<name>' for any "
        f"name in torchvision.models.list_models(module=torchvision.models) ({len(known)} models; "
        f"list them with: {_LIST_COMMAND})"
    ]


def _check_input_size(name: str, settings: TrainSettings) -> list[str]:
    """Whether the model accepts ``image_size`` inputs, tried on the meta device (no memory, no compute)."""
    size = settings.transform_args.image_size
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = _make_model(name, 2, settings)
    except Exception:
        return []  # cannot tell without building for real; build() will report it
    try:
        with torch.no_grad():
            model.eval()(torch.empty(1, 3, size, size, device="meta"))
    except Exception as exc:  # the model's own shape checks, e.g. ViT's fixed patch grid
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return [
            f"transform_args.image_size: {name} does not accept {size}x{size} images ({reason}); "
            "set transform_args.image_size to a size it supports (e.g. 224)"
        ]
    return []


def _data_path(data: Any) -> Path | None:
    return Path(data) if isinstance(data, (str, os.PathLike)) else None


def _check_folder(path: Path, bad_images: str = "error") -> list[str]:
    missing = data_path_problems("image_classification", path)
    if missing:
        return missing
    try:
        classes, samples = find_image_classes(path)
    except OSError as exc:
        return [f"data: cannot read {path}: {exc}"]
    exts = ", ".join(IMAGE_EXTENSIONS)
    if not classes:
        loose = any(f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS for f in path.iterdir())
        where = "; the images directly in it need to move into one subfolder per class" if loose else ""
        return [f"data: {path} has no class subfolders ({_DATA_HINT}{where})"]
    if not samples:
        return [f"data: no images found in the class subfolders of {path} (looked for {exts}, any letter case)"]
    problems = []
    if len(classes) < 2:
        problems.append(
            f"data: {path} has 1 class subfolder ({classes[0]!r}); classification needs at least 2 classes"
        )
    bad = find_bad_images([p for p, _ in samples])
    if bad and bad_images == "error":
        problems.append(
            f"data: {bad_images_text(path, bad, len(samples))}; remove or replace them, or set "
            "data_args.bad_images=skip to train without them"
        )
    counts = [0] * len(classes)
    for p, label in samples:
        counts[label] += p not in bad
    empty = [c for c, n in zip(classes, counts) if n == 0]
    if empty:
        readable = " readable" if bad else ""
        problems.append(
            f"data: class folders without{readable} images in {path}: {', '.join(repr(c) for c in empty)} "
            f"(looked for {exts}); add images or remove the folders"
        )
    return problems


def bad_images_text(root: Path, bad: dict[Path, str], total: int) -> str:
    """``3 of 40 images in ROOT cannot be read: cat/x.jpg (reason), ...``, the first few named."""

    def name(p: Path) -> str:
        try:
            return str(p.relative_to(root))
        except ValueError:
            return str(p)

    listed = fmt_list(sorted(bad.items()), limit=_BAD_LISTED, fmt=lambda item: f"{name(item[0])} ({item[1]})")
    return f"{len(bad)} of {total} images in {root} cannot be read: {listed}"


def check(settings: TrainSettings) -> list[str]:
    """Every problem with the image-classification settings, one line each; [] when all is well.

    Checks the model name (suggesting close matches), that the model accepts
    ``transform_args.image_size`` inputs, and that ``data`` is a folder with at least two
    class subfolders that each hold images.
    """
    name = _model_name(settings)
    problems = _check_model_name(name)
    if not problems:
        problems += _check_input_size(name, settings)
    if settings.data is not None:
        path = _data_path(settings.data)
        if path is None:
            problems.append(
                f"data: the image classification task reads an image folder path, got a "
                f"{type(settings.data).__name__} (to train on your own Dataset, pass model=<nn.Module with "
                "training_step> as well)"
            )
        else:
            problems += _check_folder(path, settings.data_args.bad_images)
    return problems


def num_samples(settings: TrainSettings) -> int:
    """Images the settings' data gives (``len`` of the dataset :func:`build` makes), without
    decoding any. Call :func:`check` first: the folder must be readable.
    """
    if settings.data is None:
        return GENERATED_NUM_IMAGES
    samples = find_image_classes(Path(settings.data))[1]
    if settings.data_args.bad_images == "skip":
        return len(samples) - len(find_bad_images([p for p, _ in samples]))
    return len(samples)


# --------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------


def build(settings: TrainSettings) -> Task:
    """The image-classification task: model, dataset and ``model_meta``.

    ``model_meta`` is ``{"num_classes": K, "classes": [names in label order]}``. Generated
    data is held in memory (``in_memory=True``); a folder is decoded on access
    (``in_memory=False``). The generated images do not depend on ``settings.seed``, which
    only sets the initial weights (and, in the trainer, data order and dropout). Call
    :func:`check` first for readable errors.
    """
    t = settings.transform_args
    transform = ImageTransform(t.image_size, t.normalize.mean, t.normalize.std)
    dataset: TensorImageDataset | ImageFolderDataset
    warnings: list[str] = []
    if settings.data is None:
        images, labels = generate_images(GENERATED_NUM_IMAGES, GENERATED_IMAGE_SIZE, GENERATED_NUM_CLASSES)
        classes = list(SHAPE_NAMES[:GENERATED_NUM_CLASSES])
        dataset = TensorImageDataset(images, labels, transform, classes)
        in_memory = True
    else:
        path = _data_path(settings.data)
        if path is None:
            raise ValueError(f"data: expected an image folder path, got {type(settings.data).__name__}")
        bad: dict[Path, str] = {}
        if settings.data_args.bad_images == "skip":
            bad = find_bad_images([p for p, _ in find_image_classes(path)[1]])
        dataset = ImageFolderDataset(path, transform, exclude=bad)
        classes = list(dataset.classes)
        in_memory = False
        if bad:
            total = len(dataset) + len(bad)
            warnings.append(f"data_args.bad_images=skip: {bad_images_text(path, bad, total)}; training without them")
    meta = {"num_classes": len(classes), "classes": classes}
    return Task(
        name="image_classification",
        model=build_model(settings, meta),
        dataset=dataset,
        model_meta=meta,
        in_memory=in_memory,
        warnings=warnings,
        model_name=name if (name := _model_name(settings)).startswith(_TORCHVISION_PREFIX) else "",
    )


def build_model(settings: TrainSettings, model_meta: dict[str, Any]) -> nn.Module:
    """The same freshly initialised model as :func:`build` makes, without reading the data.

    Args:
        settings: The run's settings (model name, ``model_args.cnn_width``, ``seed``).
        model_meta: ``Task.model_meta`` of the run, for ``num_classes``.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        return _make_model(_model_name(settings), int(model_meta["num_classes"]), settings)
