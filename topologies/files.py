"""Every file meshplan writes goes through here, so that no write replaces what it was not asked to.

A regular path is written atomically: a temporary file in the same directory,
then `os.replace`, so a failed write never leaves half a file. But a rename
replaces whatever sits at the path, which is wrong for anything but a regular
file: a symlink would be swapped for a file (write through to its target
instead), a device such as /dev/null or /dev/full would be replaced by a file
(run as root), a named pipe would be unlinked. Those are opened and written in
place, and `-` means stdout. `check_output` makes the same decisions before any
work starts, so a bad path costs a second, not a finished measurement.

Lives in `topologies`, the lowest package, so the planner and the executor
share it without an upward import.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from topologies.errors import UsageError

STDOUT = "-"

# Image formats matplotlib's Agg, PDF, PS, SVG and PGF backends write (from
# `FigureCanvasBase.get_supported_filetypes()`; a unit test keeps the two equal
# so this check needs no matplotlib import before the work starts).
IMAGE_FORMATS = ("eps", "jpeg", "jpg", "pdf", "pgf", "png", "ps", "raw", "rgba", "svg", "svgz", "tif", "tiff",
                 "webp")


def _target(path: str | Path) -> Path:
    """The path a write lands on: a symlink's final target (even a dangling one), else the path itself."""
    p = Path(path)
    return Path(os.path.realpath(p)) if p.is_symlink() else p


def _in_place(target: Path) -> bool:
    """True for an existing node a rename must not replace: a device, a pipe, a socket."""
    try:
        mode = target.stat().st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def image_format(path: str | Path, flag: str = "--png") -> str:
    """The matplotlib format a chart path asks for: its suffix, or png for stdout and devices."""
    p = str(path)
    suffix = Path(p).suffix.lower().lstrip(".")
    if suffix in IMAGE_FORMATS:
        return suffix
    if p == STDOUT or _in_place(_target(p)):
        return "png"
    raise UsageError(
        f"{flag} {p!r}: cannot tell the image format from {('suffix .' + suffix) if suffix else 'a name without a suffix'}; "
        f"end the name in .png (or one of .{', .'.join(IMAGE_FORMATS)})"
    )


def check_output(path: str | Path | None, flag: str = "-o", *, image: bool = False, stdout_ok: bool = True) -> None:
    """Refuse, before any work, an output path that cannot be written: UsageError naming the flag and path.

    Checks: not a directory; the parent directory exists and is writable for a
    file that will be created or renamed over; an existing file is writable;
    for charts, a format matplotlib writes.
    """
    if path is None:
        return
    p = str(path)
    if p == "":
        raise UsageError(f"{flag} needs a file name, got an empty string")
    if "\x00" in p:
        raise UsageError(f"{flag} {p!r}: a file name cannot hold a NUL character")
    if p == STDOUT:
        if not stdout_ok:
            raise UsageError(f"{flag} cannot write to stdout ('-'): give a file name")
        if image:
            image_format(p, flag)
        return
    target = _target(p)
    if target.is_dir():
        raise UsageError(f"{flag} {p!r} is a directory: give a file name inside it, e.g. {str(Path(p) / 'out')!r}")
    if image:
        image_format(p, flag)
    if _in_place(target):
        if not os.access(target, os.W_OK):
            raise UsageError(f"{flag} {p!r}: no permission to write to it")
        return
    parent = target.parent
    if not parent.exists():
        raise UsageError(f"{flag} {p!r}: the directory {str(parent)!r} does not exist; create it first (mkdir -p)")
    if not parent.is_dir():
        raise UsageError(f"{flag} {p!r}: {str(parent)!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {p!r}: no permission to create files in {str(parent)!r}")
    if target.exists() and not os.access(target, os.W_OK):
        raise UsageError(f"{flag} {p!r}: the file exists and is read-only")


def write_with(path: str | Path, write: Callable[[IO[bytes]], None], *, what: str = "file",
               mode: int | None = None) -> None:
    """Write `path` by calling write(binary file): atomically for a regular file, in place otherwise.

    `mode` sets the permission bits of a newly written regular file (e.g. 0o755
    for a script); an existing file keeps its own. Any OSError becomes a
    UsageError (exit 2) naming the path; the temporary file never survives.
    """
    p = str(path)
    if p == STDOUT:
        binary = getattr(sys.stdout, "buffer", None)
        if binary is None:  # a text-only stdout (an embedding program's StringIO): decode what is written
            import io

            sink = io.BytesIO()
            write(sink)
            sys.stdout.write(sink.getvalue().decode(errors="replace"))
            return
        write(binary)
        binary.flush()
        return
    target = _target(p)
    try:
        if _in_place(target):
            with open(target, "wb") as f:
                write(f)
            return
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as exc:
        raise UsageError(f"cannot write {what} to {p!r}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        try:
            keep = stat.S_IMODE(target.stat().st_mode)
        except OSError:
            umask = os.umask(0)
            os.umask(umask)
            keep = (mode if mode is not None else 0o666) & ~umask
        os.chmod(tmp, keep)
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise UsageError(f"cannot write {what} to {p!r}: {exc.strerror or exc}") from None
        if isinstance(exc, RuntimeError) and "write" in str(exc).lower():  # torch.save reports failed writes so
            raise UsageError(f"cannot write {what} to {p!r}: {str(exc).splitlines()[0]}") from None
        raise


def write_text(path: str | Path, text: str, *, what: str = "file", mode: int | None = None) -> None:
    """Write text (UTF-8) to `path`: atomic for regular files, in place for devices and pipes, `-` is stdout."""
    data = text.encode()
    write_with(path, lambda f: f.write(data), what=what, mode=mode)


def save_figure(fig, path: str | Path, flag: str = "--png") -> None:
    """Save a matplotlib figure at 120 dpi in the format the path names, through `write_with`; always closed.

    A PNG is written with a 256-colour palette (Pillow's median cut, which matplotlib installs): charts of a
    few flat colours look the same at a third of the bytes.
    """
    import matplotlib.pyplot as plt

    try:
        fmt = image_format(path, flag)
        if fmt == "png":
            import io

            from PIL import Image

            buffer = io.BytesIO()
            fig.savefig(buffer, format="png", dpi=120)
            image = Image.open(buffer).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
            write_with(path, lambda f: image.save(f, format="png", optimize=True), what="chart")
        else:
            write_with(path, lambda f: fig.savefig(f, format=fmt, dpi=120), what="chart")
    finally:
        plt.close(fig)


def is_regular_destination(path: str | Path) -> bool:
    """True when `path` names a regular file (or one to create): files beside it may be written too."""
    return str(path) != STDOUT and not _in_place(_target(path))


def read_text(path: str | Path, what: str, expect: str, error: type[Exception] = UsageError) -> str:
    """The UTF-8 text of an input file, or `error` saying what was wrong with `path` and what to give instead.

    what: how the message names the input (`--config`, `model file`);
    expect: what a user should give instead (`a .toml or .yaml file`).
    """
    name = f"{what} {str(path)!r}"
    try:
        return Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise error(f"{name} does not exist; give {expect}") from None
    except IsADirectoryError:
        raise error(f"{name} is a directory; give {expect}") from None
    except UnicodeDecodeError:
        raise error(f"{name} is not UTF-8 text (a binary file?); give {expect}") from None
    except OSError as exc:
        raise error(f"{name}: cannot read it ({exc.strerror}); give {expect}") from None

