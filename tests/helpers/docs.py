"""The README's and docs/*.md's code blocks, for the tests that run them as written.

`python_blocks(path)` lists a page's ```python blocks; `block(path, *markers, excluding=())` is
the one block that contains every marker and none of `excluding` (an error if not exactly one).
Paths are relative to the repository root: `block("docs/beam.md", "DaskRunner")`.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def python_blocks(path: str) -> list[str]:
    """The ```python blocks of the page at `path` (relative to the repository root), in order."""
    return _PYTHON_BLOCK.findall((ROOT / path).read_text())


def block(path: str, *markers: str, excluding: tuple[str, ...] = ()) -> str:
    """The one ```python block of `path` that contains every marker and none of `excluding`."""
    found = [
        code
        for code in python_blocks(path)
        if all(m in code for m in markers) and not any(e in code for e in excluding)
    ]
    assert len(found) == 1, f"{path}: {len(found)} python blocks with {markers}, not 1"
    return found[0]
