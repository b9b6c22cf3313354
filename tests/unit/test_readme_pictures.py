"""The README's pictures: each one in docs/, small, and written by a command of `make pictures`."""

from __future__ import annotations

import re

from conftest import REPO

MAX_BYTES = 120_000  # a picture in a README is read on a phone too


def test_every_embedded_picture_exists_and_is_made_by_make_pictures():
    readme = (REPO / "README.md").read_text()
    embedded = re.findall(r"!\[[^\]]*\]\((docs/[^)]+\.png)\)", readme)
    assert {"docs/timeline.png", "docs/scaling.png", "docs/memory.png", "docs/report.png"} <= set(embedded)
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("\npictures:", 1)[1].split("\n\n", 1)[0]
    for path in embedded:
        png = REPO / path
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
        assert png.stat().st_size < MAX_BYTES, (path, png.stat().st_size)
        assert f"--png {path}" in recipe, f"`make pictures` does not write {path}"
    assert "make pictures" in readme
