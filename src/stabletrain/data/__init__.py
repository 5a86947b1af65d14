"""Datasets and the built-in generated data.

* :mod:`stabletrain.data.text`: generated English-like text, byte- and character-level
  tokenization, and :class:`~stabletrain.data.text.TextDataset` (fixed-length windows).
* :mod:`stabletrain.data.images`: generated shape images, and datasets over in-memory images
  or an image folder with one subfolder per class.
* :mod:`stabletrain.data.loader`: the trainer's deterministic, resumable loader.
"""
