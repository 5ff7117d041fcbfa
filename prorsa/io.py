"""Safe outputs: checked before the work starts, written whole or not at all.

Two rules every command that writes a file follows:

* :func:`check_output` runs *before* the work: the path must be of the expected kind (a
  file path is not a folder, a folder path is not a file), its folder must be creatable
  and writable, and it may not be one of the inputs (``-o`` equal to the trace it reads
  would overwrite the source). A long simulation that fails at the very end because the
  output folder is read-only wastes the whole run.
* :func:`atomic_path` (and the ``atomic_write_*`` / :func:`atomic_dir` helpers on top of
  it) writes under a temporary name beside the target and renames it into place only
  when the write completed, so a full disk, a crash or Ctrl-C leaves the previous output
  untouched and never a half-written file under the real name.

Typical use in a command::

    out = check_output(out, inputs=[trace])
    ...  # the work
    with atomic_path(out) as tmp:
        pq.write_table(table, tmp)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Literal

from prorsa.errors import OutputError

__all__ = [
    "atomic_dir",
    "atomic_open",
    "atomic_path",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_output",
]

PathLike = str | os.PathLike[str]


def check_output(
    path: PathLike,
    *,
    kind: Literal["file", "dir"] = "file",
    inputs: Iterable[PathLike | None] = (),
) -> Path:
    """Check that ``path`` can receive an output of ``kind``; return it as a ``Path``.

    Nothing is created. Raises :class:`OutputError` naming the path when it is a folder
    where a file is expected (or the reverse), when its nearest existing folder is not
    writable or is a file, or when it is one of ``inputs`` (or, for a folder output,
    contains one of them: replacing the folder would delete the input).
    """
    out = Path(path)
    if kind == "file" and out.is_dir():
        raise OutputError(
            "is a directory, but a file path is expected", path=str(out), hint=_NAME_A_FILE
        )
    if kind == "dir" and out.exists() and not out.is_dir():
        raise OutputError(
            "exists and is not a directory, but an output folder is expected",
            path=str(out),
            hint="give a folder path (it is created if missing)",
        )
    for source in inputs:
        if source is not None and _overlaps(out, Path(source), kind):
            raise OutputError(
                f"is also an input ({source}); writing it would overwrite the data being read",
                path=str(out),
                hint="choose a different output path",
            )
    anchor = _nearest_existing(out.parent if kind == "file" else out)
    if not anchor.is_dir():
        raise OutputError(
            f"cannot create it: {anchor} is a file, not a folder",
            path=str(out),
            hint="choose an output path whose folders are folders",
        )
    if not os.access(anchor, os.W_OK | os.X_OK):
        raise OutputError(f"folder {anchor} is not writable", path=str(out), hint=_WRITABLE_HINT)
    if kind == "file" and out.exists() and not os.access(out, os.W_OK):
        # A rename would replace it anyway, but a read-only file is usually a protected one.
        raise OutputError("exists and is read-only", path=str(out), hint=_WRITABLE_HINT)
    return out


def is_utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8, as every Parquet/Arrow string must. A str can
    hold lone surrogates (a JSON ``\\ud800`` escape, an undecodable file name) that do not;
    one such value fails every row written beside it, so callers refuse it on arrival."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def file_sha256(path: PathLike) -> str:
    """Hex SHA-256 of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@contextlib.contextmanager
def atomic_path(path: PathLike, *, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary file path beside ``path``; rename it onto ``path`` on success.

    The caller writes the whole output to the yielded path. When the block raises
    (a full disk, Ctrl-C, a bug), the temporary file is removed and any previous file at
    ``path`` stays as it was. With ``durable`` the data is flushed to disk (``fsync``)
    before the rename, so a power loss cannot leave an empty file under the real name.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(target)
    try:
        yield tmp
        if durable and tmp.is_file():
            _fsync_file(tmp)
        os.replace(tmp, target)
    except BaseException:
        _remove(tmp)
        raise
    if durable:
        _fsync_dir(target.parent)


@contextlib.contextmanager
def atomic_open(
    path: PathLike, mode: Literal["w", "wb"] = "w", *, encoding: str | None = "utf-8"
) -> Iterator[IO]:
    """Open a temporary file for writing; it replaces ``path`` when the block completes."""
    with atomic_path(path) as tmp:
        if "b" in mode:
            with open(tmp, mode) as handle:
                yield handle
        else:
            with open(tmp, mode, encoding=encoding) as handle:
                yield handle


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: PathLike, text: str, *, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` whole or not at all."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding=encoding)


@contextlib.contextmanager
def atomic_dir(path: PathLike) -> Iterator[Path]:
    """Yield a new temporary folder beside ``path``; it replaces ``path`` on success.

    An existing folder at ``path`` is moved aside first and deleted only once the new one
    is in place; if the block raises, the temporary folder is removed and the old one kept.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(target)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    old = None
    if target.exists():
        old = _temp_name(target, "old")
        os.replace(target, old)
    try:
        os.replace(tmp, target)
    except BaseException:
        if old is not None:
            os.replace(old, target)
        _remove(tmp)
        raise
    if old is not None:
        _remove(old)


# ----------------------------------------------------------------------------- helpers
_NAME_A_FILE = "give a file path (its folder is created if missing)"
_WRITABLE_HINT = "choose an output on a writable file system, or fix the folder's permissions"


def _overlaps(out: Path, source: Path, kind: str) -> bool:
    if not source.exists():
        return False
    if out.exists() and _same(out, source):
        return True
    out_abs, source_abs = _resolved(out), _resolved(source)
    if out_abs == source_abs:
        return True
    # A folder output holding an input: replacing or filling the folder can destroy it.
    return kind == "dir" and out_abs in source_abs.parents


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _resolved(path: Path) -> Path:
    return path.expanduser().resolve(strict=False)


def _nearest_existing(path: Path) -> Path:
    path = _resolved(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _temp_name(target: Path, tag: str = "tmp") -> Path:
    # Hidden, unique and in the same folder: the rename stays on one file system.
    return target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.{tag}")


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    # Makes the rename itself durable; not every file system supports it, so best effort.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
