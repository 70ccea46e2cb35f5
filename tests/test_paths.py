"""The one atomic writer: a file or a directory appears whole or not at all."""

import pytest

from dflash2_mlx.paths import atomic_path


def test_a_file_and_a_directory_replace_their_destination(tmp_path):
    f = tmp_path / "a" / "x.json"
    for text in ("one", "two"):
        with atomic_path(f) as tmp:
            assert tmp.suffix == ".json" and tmp.parent == f.parent
            tmp.write_text(text)
        assert f.read_text() == text
    d = tmp_path / "dir"
    for name in ("first", "second"):
        with atomic_path(d) as tmp:
            tmp.mkdir()
            (tmp / name).write_text(name)
        assert [p.name for p in d.iterdir()] == [name]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "dir"]  # nothing left behind


def test_an_error_leaves_the_old_content_and_no_temporary(tmp_path):
    f = tmp_path / "x.txt"
    f.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(f) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash")
    assert f.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["x.txt"]
    d = tmp_path / "d"
    d.mkdir()
    (d / "keep").write_text("k")
    with pytest.raises(RuntimeError):
        with atomic_path(d) as tmp:
            tmp.mkdir()
            raise RuntimeError("crash")
    assert [p.name for p in d.iterdir()] == ["keep"] and sorted(p.name for p in tmp_path.iterdir()) == ["d", "x.txt"]
