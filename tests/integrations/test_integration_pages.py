"""The integration pages show their example files as they are, and the README links them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = {
    "lightning.md": "lightning_example.py",
    "hf_trainer.md": "hf_trainer_example.py",
    "accelerate.md": "accelerate_example.py",
}


@pytest.mark.parametrize("page, example", PAGES.items())
def test_page_shows_its_example_file_verbatim(page, example):
    text = (ROOT / "docs" / "integrations" / page).read_text()
    marker = f"<!-- file: examples/integrations/{example} -->\n```python\n"
    assert marker in text, f"{page} has no example block for {example}"
    block = text.split(marker, 1)[1].split("```\n", 1)[0]
    assert block == (ROOT / "examples" / "integrations" / example).read_text()
    assert not re.search(r"OVERHEAD_[A-Z]+", text), "the overhead figures are filled in"


def test_readme_links_the_three_pages_where_it_lists_the_tools():
    """In the paragraph on using each tool on its own, near the top (not only in the docs index)."""
    text = (ROOT / "README.md").read_text()
    start = text.index("Each tool also works on its own")
    paragraph = text[start:].split("\n\n", 1)[0]
    for page in PAGES:
        assert f"(docs/integrations/{page})" in paragraph
