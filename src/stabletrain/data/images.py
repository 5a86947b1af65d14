"""Image data for the image-classification task.

* :func:`generate_images`: deterministic synthetic shapes, the built-in dataset.
* :class:`TensorImageDataset`: in-memory ``uint8`` images and labels.
* :class:`ImageFolderDataset`: a folder with one subfolder per class, read with PIL.

Both datasets apply the same :class:`ImageTransform` (resize to a square, scale to [0, 1],
normalize), so generated and folder data reach the model in the same form: ``ds[i]`` is
``(FloatTensor[3, S, S], LongTensor scalar label)``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Collection, Optional, Sequence

import torch
from torch.utils.data import Dataset
from torchvision.transforms.v2 import functional as TF

__all__ = [
    "IMAGE_EXTENSIONS",
    "SHAPE_NAMES",
    "ImageFolderDataset",
    "ImageTransform",
    "TensorImageDataset",
    "find_bad_images",
    "find_image_classes",
    "generate_images",
    "image_problem",
]

#: File extensions (lower case) that :class:`ImageFolderDataset` loads.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")

#: Class names of :func:`generate_images`, in label order.
SHAPE_NAMES = ("disc", "square", "cross", "ring", "triangle", "hbar", "vbar", "diagonal")


# --------------------------------------------------------------------------------------
# Generated images
# --------------------------------------------------------------------------------------


def _shape_mask(name: str, dx: torch.Tensor, dy: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Boolean mask of one shape, from pixel offsets to its centre and its radius."""
    adx, ady = dx.abs(), dy.abs()
    thick = 0.35 * r
    if name == "disc":
        return dx**2 + dy**2 <= r**2
    if name == "square":
        return torch.maximum(adx, ady) <= 0.85 * r
    if name == "cross":
        return ((adx <= thick) & (ady <= r)) | ((ady <= thick) & (adx <= r))
    if name == "ring":
        d2 = dx**2 + dy**2
        return (d2 <= r**2) & (d2 >= (0.55 * r) ** 2)
    if name == "triangle":  # apex up: half-width grows linearly from the top edge
        return (dy >= -r) & (dy <= 0.8 * r) & (adx <= 0.6 * (dy + r))
    if name == "hbar":
        return (ady <= thick) & (adx <= r)
    if name == "vbar":
        return (adx <= thick) & (ady <= r)
    if name == "diagonal":
        return ((dx - dy).abs() <= thick * 1.4) & (adx <= r) & (ady <= r)
    raise ValueError(f"unknown shape {name!r}")


def generate_images(
    num_images: int, image_size: int, num_classes: int = 4, seed: int = 1234
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic synthetic images of shapes; the class is the shape.

    Class ``k`` is ``SHAPE_NAMES[k]`` (disc, square, cross, ring, ...). Each image has a
    random background colour, a shape of random size, position and colour, and Gaussian
    pixel noise, so colour and position say nothing about the class and a model has to
    learn the shapes. Labels are balanced (each class ``num_images // num_classes`` times,
    give or take one) and shuffled.

    Args:
        num_images: Number of images N.
        image_size: Height and width H = W in pixels (at least 8).
        num_classes: Number of classes, 2 to ``len(SHAPE_NAMES)``.
        seed: Seed of a private ``torch.Generator``; the global RNG is not touched.

    Returns:
        ``(images, labels)``: a ``uint8`` tensor ``(N, 3, H, W)`` and a ``long`` tensor ``(N,)``.

    Example::

        images, labels = generate_images(2048, 32)
        images.shape, labels.bincount()  # (2048, 3, 32, 32), tensor([512, 512, 512, 512])
    """
    if not 2 <= num_classes <= len(SHAPE_NAMES):
        raise ValueError(f"num_classes must be between 2 and {len(SHAPE_NAMES)}, got {num_classes}")
    if image_size < 8:
        raise ValueError(f"image_size must be >= 8, got {image_size}")
    if num_images < 0:
        raise ValueError(f"num_images must be >= 0, got {num_images}")
    g = torch.Generator().manual_seed(seed)
    n, s = num_images, image_size
    labels = (torch.arange(n) % num_classes)[torch.randperm(n, generator=g)]

    def uniform(lo: float, hi: float, *shape: int) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(*shape, generator=g)

    radius = uniform(0.18, 0.32, n) * s
    # Keep the whole shape inside the image.
    cx = radius + uniform(0, 1, n) * (s - 1 - 2 * radius)
    cy = radius + uniform(0, 1, n) * (s - 1 - 2 * radius)
    background = uniform(0.0, 0.45, n, 3)
    # The shape is brighter than the background in at least one channel, by a random margin.
    foreground = (background + uniform(0.25, 0.55, n, 3) * (torch.rand(n, 3, generator=g) < 0.7)).clamp(max=1.0)
    weak = (foreground - background).amax(dim=1) < 0.25
    foreground[weak] = (background[weak] + 0.4).clamp(max=1.0)
    noise = torch.randn(n, 3, s, s, generator=g) * 0.08

    coords = torch.arange(s, dtype=torch.float32)
    dx = coords.view(1, 1, s) - cx.view(n, 1, 1)
    dy = coords.view(1, s, 1) - cy.view(n, 1, 1)
    r = radius.view(n, 1, 1)
    mask = torch.zeros(n, s, s, dtype=torch.bool)
    for k in range(num_classes):
        idx = (labels == k).nonzero().squeeze(1)
        mask[idx] = _shape_mask(SHAPE_NAMES[k], dx[idx], dy[idx], r[idx])

    m = mask.unsqueeze(1)
    images = torch.where(m, foreground.view(n, 3, 1, 1), background.view(n, 3, 1, 1)) + noise
    images = (images.clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)
    return images, labels


# --------------------------------------------------------------------------------------
# Transform and datasets
# --------------------------------------------------------------------------------------


class ImageTransform:
    """``uint8`` image ``(3, H, W)`` -> normalized float image ``(3, S, S)``.

    Resizes to ``image_size`` x ``image_size`` (bilinear, antialiased; skipped when the image
    already has that size), scales to [0, 1] and normalizes per channel:
    ``(x / 255 - mean) / std``.

    Args:
        image_size: Output height and width S.
        mean: Per-channel mean of images in [0, 1].
        std: Per-channel standard deviation.
    """

    def __init__(self, image_size: int, mean: Sequence[float], std: Sequence[float]):
        self.image_size = image_size
        self.mean = torch.tensor(list(mean), dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(list(std), dtype=torch.float32).view(3, 1, 1)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[0] != 3:
            raise ValueError(f"expected a uint8 image of shape (3, H, W), got {image.dtype} {tuple(image.shape)}")
        s = self.image_size
        if tuple(image.shape[1:]) != (s, s):
            image = TF.resize(image, [s, s], antialias=True)
        return (image.float() / 255.0 - self.mean) / self.std

    def __repr__(self) -> str:
        return (
            f"ImageTransform(image_size={self.image_size}, mean={self.mean.flatten().tolist()}, "
            f"std={self.std.flatten().tolist()})"
        )


class TensorImageDataset(Dataset):
    """In-memory ``uint8`` images with integer labels.

    Args:
        images: ``uint8`` tensor ``(N, 3, H, W)``.
        labels: Integer tensor ``(N,)``.
        transform: Applied to each image on access.
        classes: Class names, label order.
    """

    def __init__(
        self, images: torch.Tensor, labels: torch.Tensor, transform: ImageTransform, classes: Sequence[str] = ()
    ):
        if images.dim() != 4 or images.shape[1] != 3 or images.dtype != torch.uint8:
            raise ValueError(f"images must be uint8 (N, 3, H, W), got {images.dtype} {tuple(images.shape)}")
        if labels.shape != (images.shape[0],):
            raise ValueError(f"labels must have shape ({images.shape[0]},), got {tuple(labels.shape)}")
        self.images = images
        self.labels = labels.long()
        self.transform = transform
        self.classes = list(classes)

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.transform(self.images[index]), self.labels[index].clone()


def _is_image_file(path: Path) -> bool:
    # Dot files are skipped: e.g. macOS "._x.jpg" resource forks carry an image extension.
    return path.suffix.lower() in IMAGE_EXTENSIONS and not path.name.startswith(".")


def find_image_classes(root: str | os.PathLike) -> tuple[list[str], list[tuple[Path, int]]]:
    """Class names and ``(image path, label)`` samples of an image folder.

    Every subfolder of ``root`` is a class; classes are sorted by name and labelled 0, 1, ...
    in that order. A class's images are all files below its subfolder (at any depth) with
    an extension in :data:`IMAGE_EXTENSIONS` (case-insensitive), sorted by path. Hidden
    folders and files (names starting with ".") are ignored.

    Returns:
        ``(classes, samples)``; classes without images still appear in ``classes``.
    """
    root = Path(root)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    samples: list[tuple[Path, int]] = []
    for label, name in enumerate(classes):
        files: list[Path] = []
        for dirpath, dirnames, filenames in os.walk(root / name, followlinks=True):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            files.extend(Path(dirpath) / f for f in filenames if _is_image_file(Path(f)))
        samples.extend((f, label) for f in sorted(files))
    return classes, samples


# --------------------------------------------------------------------------------------
# Unreadable files
# --------------------------------------------------------------------------------------

#: JPEG's end-of-image marker: a file cut short lacks it (PIL's verify() does not read that far).
_JPEG_END = b"\xff\xd9"
#: (path, size, modification time) -> problem or None: the task checks, the dataset size check
#: and the dataset itself each ask about the same files.
_checked: dict[tuple[str, int, int], Optional[str]] = {}


def image_problem(path: str | os.PathLike) -> Optional[str]:
    """Why PIL cannot read the image file at ``path`` (one line), or None when it can.

    What it reads: PNG files in full without decoding them (``verify()`` checks every chunk's
    checksum); JPEG files' headers (``verify()``) and last bytes, which must hold the
    end-of-image marker, and in full only when they do not (a file cut short, or with bytes
    appended after the image); files of other formats are decoded. A PNG or JPEG costs about
    0.1 ms whatever its size; an image of another format costs one decode.
    """
    from PIL import Image

    path = Path(path)
    try:
        with Image.open(path) as img:
            fmt = img.format
            if fmt == "PNG":
                img.verify()
                return None
            if fmt == "JPEG":
                img.verify()
                if _jpeg_ends_whole(path):
                    return None
        with Image.open(path) as img:
            img.convert("RGB")  # what ImageFolderDataset does with it
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, struct.error, ...
        return _reason(exc)
    return None


def _jpeg_ends_whole(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 2))
        return f.read(2) == _JPEG_END


def _reason(exc: BaseException) -> str:
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    if type(exc).__name__ == "UnidentifiedImageError":
        return "not an image file PIL can read"
    return first or type(exc).__name__


def find_bad_images(paths: Sequence[Path]) -> dict[Path, str]:
    """The files among ``paths`` that cannot be read as images, each with the reason
    (:func:`image_problem`); files already checked and unchanged since are not read again."""
    bad: dict[Path, str] = {}
    for path in paths:
        try:
            st = os.stat(path)
        except OSError as exc:
            bad[path] = f"cannot open it ({exc.strerror or exc})"
            continue
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key not in _checked:
            _checked[key] = "the file is empty (0 bytes)" if st.st_size == 0 else image_problem(path)
        if _checked[key] is not None:
            bad[path] = _checked[key]  # type: ignore[assignment]
    return bad


class ImageFolderDataset(Dataset):
    """Images in ``root/<class name>/...``, loaded with PIL and converted to RGB.

    See :func:`find_image_classes` for which files count. Images are decoded on access, so
    the dataset suits DataLoader worker processes.

    Args:
        root: The folder holding one subfolder per class.
        transform: Applied to each decoded ``uint8`` image.
        exclude: Files to leave out, e.g. those :func:`find_bad_images` reports.

    Attributes:
        classes: Class names, sorted; label ``k`` is ``classes[k]``.
        samples: ``(path, label)`` pairs in dataset order.
    """

    def __init__(self, root: str | os.PathLike, transform: ImageTransform, exclude: Collection[Path] = ()):
        self.root = Path(root)
        self.transform = transform
        self.classes, self.samples = find_image_classes(self.root)
        if exclude:
            left_out = set(exclude)
            self.samples = [(p, label) for p, label in self.samples if p not in left_out]
        if not self.samples:
            exts = ", ".join(IMAGE_EXTENSIONS)
            raise ValueError(f"no images found in the class subfolders of {self.root} (looked for {exts})")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image

        path, label = self.samples[index]
        try:
            with Image.open(path) as img:
                rgb = img.convert("RGB")
        except Exception as exc:  # changed since the check before training, or never checked
            raise ValueError(
                f"cannot read the image {path}: {_reason(exc)}; remove or replace the file "
                "(stabletrain train checks every image before training: data_args.bad_images)"
            ) from None
        image = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(rgb.height, rgb.width, 3)
        return self.transform(image.permute(2, 0, 1).contiguous()), torch.tensor(label, dtype=torch.long)
