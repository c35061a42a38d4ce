"""The README's code blocks, as the tests that run them as printed read them."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_blocks(section: str, lang: str) -> list[str]:
    """The ```{lang} blocks of the README's `## {section}` section, in order, as printed."""
    text = README.read_text()
    start = text.index(f"\n## {section}\n")
    body = text[start:]
    body = body[: body.index("\n## ", 1)]
    return re.findall(rf"```{lang}\n(.*?)```", body, re.S)
