"""Whether a data path is what a built-in task reads, checked without torch (``stabletrain train``
runs it before importing torch; the tasks run it again with their own reading of the contents)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["IMAGE_DATA_HINT", "TEXT_DATA_HINT", "data_path_problems"]

TEXT_DATA_HINT = "give a UTF-8 text file, or omit data for the built-in generated text"
IMAGE_DATA_HINT = (
    "give a folder with one subfolder of images per class, or omit data for the built-in generated images"
)


def data_path_problems(task: str, path: Path) -> list[str]:
    """Whether ``path`` exists and is what ``task`` reads: a text file for the language model,
    a folder for image classification. What is inside is the task's own check."""
    if task == "language_model":
        if not path.exists():
            return [f"data: file not found: {path} ({TEXT_DATA_HINT})"]
        if path.is_dir():
            return [
                f"data: {path} is a directory, the language model needs a text file ({TEXT_DATA_HINT}; "
                "for an image folder set model='cnn' or 'torchvision/<name>')"
            ]
        if not path.is_file():
            return [f"data: {path} is not a regular file ({TEXT_DATA_HINT})"]
    elif task == "image_classification":
        if not path.exists():
            return [f"data: folder not found: {path} ({IMAGE_DATA_HINT})"]
        if not path.is_dir():
            return [f"data: {path} is not a folder ({IMAGE_DATA_HINT}; for a text file use the language model task)"]
    return []
