"""topologies.files: writes never replace what they were not asked to, and bad paths fail before any work."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from topologies.errors import UsageError
from topologies.files import IMAGE_FORMATS, check_output, image_format, write_text, write_with


def test_regular_file_is_replaced_atomically_and_keeps_its_mode(tmp_path):
    target = tmp_path / "plan.json"
    target.write_text("old")
    target.chmod(0o640)
    write_text(target, "new")
    assert target.read_text() == "new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no temporary file left


def test_new_file_gets_the_requested_mode(tmp_path):
    write_text(tmp_path / "run.sh", "#!/bin/sh\n", mode=0o755)
    assert os.access(tmp_path / "run.sh", os.X_OK)


def test_symlink_is_written_through_to_its_target(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_text(link, "new")
    assert link.is_symlink() and real.read_text() == "new"


def test_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "made.json")
    write_text(link, "x")
    assert link.is_symlink() and (tmp_path / "made.json").read_text() == "x"


def test_fifo_is_written_in_place_not_replaced(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    read_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader, so opening for writing does not block
    try:
        write_text(fifo, "through the pipe")
        assert os.read(read_fd, 100) == b"through the pipe"
    finally:
        os.close(read_fd)
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_dev_null_stays_a_device():
    write_text("/dev/null", "nothing")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_dash_is_stdout(capfdbinary):
    write_text("-", "to stdout\n")
    assert capfdbinary.readouterr().out == b"to stdout\n"


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "keep.json"
    target.write_text("old")

    def fail(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(UsageError, match="No space left"):
        write_with(target, fail, what="plan")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.json"]


@pytest.mark.parametrize("name, expect", [
    ("missing/dir/out.json", "does not exist"),
    (".", "is a directory"),
    ("file/inside.json", "is not a directory"),
    ("", "needs a file name"),
])
def test_check_output_refuses_unwritable_paths(tmp_path, name, expect):
    (tmp_path / "file").write_text("")
    path = "" if name == "" else str(tmp_path / name)
    with pytest.raises(UsageError, match=expect):
        check_output(path, "-o")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_check_output_refuses_a_read_only_directory(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(UsageError, match="no permission"):
            check_output(tmp_path / "x.json", "-o")
    finally:
        tmp_path.chmod(0o700)


def test_image_formats_come_from_the_suffix(tmp_path):
    assert image_format(tmp_path / "a.SVG") == "svg"
    assert image_format("-") == "png"
    assert image_format("/dev/null") == "png"
    for bad in ("out.txt", "out"):
        with pytest.raises(UsageError, match=r"end the name in \.png"):
            check_output(tmp_path / bad, "--png", image=True)
    check_output(tmp_path / "chart.pdf", "--png", image=True)


def test_image_formats_are_what_matplotlib_writes():
    from matplotlib.backend_bases import FigureCanvasBase

    assert set(IMAGE_FORMATS) <= set(FigureCanvasBase.get_supported_filetypes())


def test_check_output_refuses_stdout_where_it_makes_no_sense():
    with pytest.raises(UsageError, match="stdout"):
        check_output("-", "--out", stdout_ok=False)
    check_output("-", "-o")  # allowed by default


def test_save_figure_writes_the_format_the_suffix_names(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from topologies.files import save_figure

    fig, ax = plt.subplots()
    ax.plot([0, 1])
    save_figure(fig, tmp_path / "c.svg")
    assert (tmp_path / "c.svg").read_text().lstrip().startswith("<?xml")
    assert sys.modules["matplotlib"] is matplotlib


def test_save_figure_writes_a_palette_png(tmp_path):
    """PNGs are quantized to 256 colours: the image matplotlib rendered, at 120 dpi, in far fewer bytes."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from PIL import Image

    from topologies.files import save_figure

    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1, 2], [0, 1, 0], "o-")
    full = io.BytesIO()
    fig.savefig(full, format="png", dpi=120)
    save_figure(fig, tmp_path / "c.png")
    image = Image.open(tmp_path / "c.png")
    assert image.mode == "P" and image.size == (480, 360)
    assert (tmp_path / "c.png").stat().st_size < len(full.getvalue())
    rendered = np.asarray(Image.open(io.BytesIO(full.getvalue())).convert("RGB"), dtype=int)
    assert np.abs(np.asarray(image.convert("RGB"), dtype=int) - rendered).max() < 48  # within a few shades
