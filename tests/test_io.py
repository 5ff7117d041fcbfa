"""Safe outputs: checked before the work, written whole or not at all."""

from __future__ import annotations

import errno
import os

import pytest

from prorsa.errors import OutputError
from prorsa.io import atomic_dir, atomic_path, atomic_write_text, check_output

needs_permissions = pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores folder permissions"
)


def test_check_output_accepts_a_new_file_in_a_new_folder(tmp_path):
    out = check_output(tmp_path / "a" / "b" / "out.parquet")
    assert out == tmp_path / "a" / "b" / "out.parquet"
    assert not (tmp_path / "a").exists()  # nothing is created by the check


def test_check_output_refuses_a_folder_where_a_file_goes(tmp_path):
    with pytest.raises(OutputError, match="is a directory"):
        check_output(tmp_path)


def test_check_output_refuses_a_file_where_a_folder_goes(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="not a directory"):
        check_output(tmp_path / "f", kind="dir")
    with pytest.raises(OutputError, match="is a file, not a folder"):
        check_output(tmp_path / "f" / "out.json")


def test_check_output_refuses_an_input(tmp_path):
    trace = tmp_path / "trace.parquet"
    trace.write_bytes(b"data")
    with pytest.raises(OutputError, match="is also an input"):
        check_output(tmp_path / "." / "trace.parquet", inputs=[trace])
    link = tmp_path / "link.parquet"
    link.symlink_to(trace)
    with pytest.raises(OutputError, match="is also an input"):
        check_output(link, inputs=[trace])
    # A folder output that holds an input would be replaced with the input inside it.
    with pytest.raises(OutputError, match="is also an input"):
        check_output(tmp_path, kind="dir", inputs=[trace])
    assert check_output(tmp_path / "other.parquet", inputs=[trace, None])


@needs_permissions
def test_check_output_refuses_a_read_only_folder(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(OutputError, match="not writable"):
            check_output(locked / "sub" / "out.json")
    finally:
        locked.chmod(0o700)


def test_atomic_path_keeps_the_old_file_when_the_write_fails(tmp_path):
    out = tmp_path / "metrics.json"
    out.write_text("old")
    with pytest.raises(OSError), atomic_path(out) as tmp:
        tmp.write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert out.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]  # no temp left
    atomic_write_text(out, "new")
    assert out.read_text() == "new"


def test_atomic_path_on_ctrl_c_leaves_no_file(tmp_path):
    out = tmp_path / "x.parquet"
    with pytest.raises(KeyboardInterrupt), atomic_path(out) as tmp:
        tmp.write_bytes(b"partial")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_atomic_dir_replaces_a_folder_only_on_success(tmp_path):
    out = tmp_path / "model"
    with atomic_dir(out) as tmp:
        (tmp / "a.json").write_text("1")
    assert (out / "a.json").read_text() == "1"
    with pytest.raises(RuntimeError), atomic_dir(out) as tmp:
        (tmp / "b.json").write_text("2")
        raise RuntimeError("failed mid-way")
    assert sorted(p.name for p in out.iterdir()) == ["a.json"]
    with atomic_dir(out) as tmp:
        (tmp / "c.json").write_text("3")
    assert sorted(p.name for p in out.iterdir()) == ["c.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
