"""``fileio.atomic_path``: the target appears whole or not at all, with the mode a plain
``open()`` gives a new file under the process umask; ``output_dir_problem`` says why a
directory cannot be written there."""

from __future__ import annotations

import os

import pytest

from reap_modifier.fileio import atomic_path, output_dir_problem, write_atomic, write_json_atomic


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_atomic_files_get_the_mode_of_a_plain_open(tmp_path, umask):
    old = os.umask(umask)
    try:
        (tmp_path / "plain").write_text("x")
        write_atomic(tmp_path / "a.md", "x")
        write_json_atomic(tmp_path / "b.json", {"x": 1})
        with atomic_path(tmp_path / "c.bin") as tmp:
            tmp.write_bytes(b"x")
    finally:
        os.umask(old)
    want = (tmp_path / "plain").stat().st_mode & 0o777
    assert want == 0o666 & ~umask
    for name in ("a.md", "b.json", "c.bin"):
        assert (tmp_path / name).stat().st_mode & 0o777 == want, name


def test_a_failed_write_leaves_the_target_and_no_temp_file(tmp_path):
    (tmp_path / "t").write_text("old")
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "t") as tmp:
        tmp.write_text("half")
        raise RuntimeError
    assert (tmp_path / "t").read_text() == "old" and os.listdir(tmp_path) == ["t"]


def test_output_dir_problem(tmp_path):
    f = tmp_path / "f"
    f.write_text("")
    assert output_dir_problem(tmp_path / "new" / "deeper") is None
    assert output_dir_problem(tmp_path) is None
    assert output_dir_problem(f) == f"{f} is a file, not a directory"
    assert (
        output_dir_problem(f / "x" / "y")
        == f"{f} is a file, so {f / 'x' / 'y'} cannot be a directory under it"
    )
    assert not (tmp_path / "new").exists()  # checks only
