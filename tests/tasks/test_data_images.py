"""Generated images, the shared transform and the image-folder dataset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stabletrain.data.images import (
    SHAPE_NAMES,
    ImageFolderDataset,
    ImageTransform,
    TensorImageDataset,
    generate_images,
)

MEAN = (0.5, 0.4, 0.3)
STD = (0.2, 0.25, 0.3)


def _expected(rgb_hwc_uint8: np.ndarray) -> torch.Tensor:
    """The normalized image computed independently, in float64."""
    x = rgb_hwc_uint8.astype(np.float64).transpose(2, 0, 1) / 255.0
    return torch.from_numpy((x - np.array(MEAN).reshape(3, 1, 1)) / np.array(STD).reshape(3, 1, 1))


def test_generate_images_is_deterministic_balanced_and_uint8():
    images, labels = generate_images(64, 16, num_classes=4, seed=3)
    assert images.shape == (64, 3, 16, 16) and images.dtype == torch.uint8
    assert labels.shape == (64,) and labels.dtype == torch.long
    assert labels.bincount().tolist() == [16, 16, 16, 16]
    images2, labels2 = generate_images(64, 16, num_classes=4, seed=3)
    assert torch.equal(images, images2) and torch.equal(labels, labels2)
    images3, _ = generate_images(64, 16, num_classes=4, seed=4)
    assert not torch.equal(images, images3)


def test_generate_images_does_not_touch_the_global_rng():
    state = torch.get_rng_state()
    generate_images(8, 16)
    assert torch.equal(state, torch.get_rng_state())


def test_generate_images_classes_are_different_shapes():
    images, labels = generate_images(400, 32, num_classes=len(SHAPE_NAMES))
    assert set(labels.tolist()) == set(range(len(SHAPE_NAMES)))
    # Fraction of pixels clearly brighter than the (mostly background) median, per class.
    brightness = images.float().mean(dim=1)
    fg_fraction = []
    for k in range(len(SHAPE_NAMES)):
        imgs = brightness[labels == k]
        thresh = imgs.flatten(1).median(dim=1).values.view(-1, 1, 1)
        fg_fraction.append((imgs > thresh + 40).float().mean().item())
    # A bar covers less area than a disc, and so does a ring (it has a hole).
    assert fg_fraction[SHAPE_NAMES.index("hbar")] < fg_fraction[SHAPE_NAMES.index("disc")]
    assert fg_fraction[SHAPE_NAMES.index("ring")] < fg_fraction[SHAPE_NAMES.index("disc")]


def test_generate_images_rejects_bad_class_count():
    with pytest.raises(ValueError, match="num_classes"):
        generate_images(8, 16, num_classes=len(SHAPE_NAMES) + 1)


def test_transform_normalizes_like_float64_and_resizes():
    rng = np.random.default_rng(0)
    hwc = rng.integers(0, 256, size=(12, 12, 3), dtype=np.uint8)
    image = torch.from_numpy(hwc).permute(2, 0, 1).contiguous()
    out = ImageTransform(12, MEAN, STD)(image)
    assert out.dtype == torch.float32 and out.shape == (3, 12, 12)
    torch.testing.assert_close(out.double(), _expected(hwc), rtol=0, atol=1e-6)
    resized = ImageTransform(20, MEAN, STD)(image)
    assert resized.shape == (3, 20, 20)
    # A constant image stays constant through the resize.
    flat = torch.full((3, 12, 12), 128, dtype=torch.uint8)
    torch.testing.assert_close(
        ImageTransform(20, MEAN, STD)(flat), _expected(np.full((20, 20, 3), 128, np.uint8)).float()
    )


def test_tensor_dataset_items():
    images, labels = generate_images(10, 16)
    ds = TensorImageDataset(images, labels, ImageTransform(24, MEAN, STD), classes=["a", "b", "c", "d"])
    assert len(ds) == 10
    x, y = ds[3]
    assert x.shape == (3, 24, 24) and x.dtype == torch.float32
    assert y.shape == () and y.dtype == torch.long and int(y) == int(labels[3])


def _write(path: Path, array: np.ndarray) -> None:
    """Save an (H, W, 3) array as RGB or an (H, W) array as grayscale."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


def test_image_folder_reads_sorted_classes_and_normalizes(tmp_path: Path):
    rng = np.random.default_rng(1)
    cat = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    dog1 = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    gray = rng.integers(0, 256, size=(8, 8), dtype=np.uint8)
    _write(tmp_path / "dog" / "1.png", dog1)
    _write(tmp_path / "dog" / "nested" / "2.PNG", gray)
    _write(tmp_path / "cat" / "a.png", cat)
    (tmp_path / "cat" / "notes.txt").write_text("not an image")
    _write(tmp_path / "cat" / "._a.png", cat)  # hidden: ignored
    ds = ImageFolderDataset(tmp_path, ImageTransform(8, MEAN, STD))
    assert ds.classes == ["cat", "dog"]
    assert [(p.relative_to(tmp_path).as_posix(), y) for p, y in ds.samples] == [
        ("cat/a.png", 0),
        ("dog/1.png", 1),
        ("dog/nested/2.PNG", 1),
    ]
    x, y = ds[0]
    assert x.shape == (3, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.long and int(y) == 0
    torch.testing.assert_close(x.double(), _expected(cat), rtol=0, atol=1e-6)
    x2, y2 = ds[2]
    assert int(y2) == 1
    torch.testing.assert_close(x2.double(), _expected(np.stack([gray] * 3, axis=-1)), rtol=0, atol=1e-6)


def test_image_folder_resizes_to_image_size(tmp_path: Path):
    _write(tmp_path / "a" / "x.png", np.zeros((10, 30, 3), np.uint8))
    _write(tmp_path / "b" / "y.jpg", np.full((40, 20, 3), 255, np.uint8))
    ds = ImageFolderDataset(tmp_path, ImageTransform(16, MEAN, STD))
    assert ds[0][0].shape == (3, 16, 16) and ds[1][0].shape == (3, 16, 16)


def test_image_folder_without_images_raises(tmp_path: Path):
    (tmp_path / "a").mkdir()
    with pytest.raises(ValueError, match=r"no images found.*\.png"):
        ImageFolderDataset(tmp_path, ImageTransform(8, MEAN, STD))
