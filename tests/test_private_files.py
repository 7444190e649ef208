"""A job's files are private to its user (tf_adasum/launch/private_files.py): its folders are refused where
another user owns or can write them or a folder above them, its files are 0600, written whole, and
read without following a link. The two-user cases run as root (as CI does), the intruder as nobody."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.support.users import as_nobody, as_root
from tf_adasum.launch.private_files import private_directory, read_private, write_private


def test_missing_folders_are_made_private(tmp_path: Path) -> None:
    made = private_directory(str(tmp_path / "a" / "b"), "--state-dir")
    assert made == str(tmp_path / "a" / "b")
    for folder in (tmp_path / "a", tmp_path / "a" / "b"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_a_folder_others_can_write_is_refused_naming_it_and_the_fix(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(
        PermissionError, match=r"--state-dir .*shared: .*shared can be written by others \(mode 777\)"
    ) as refused:
        private_directory(str(shared), "--state-dir")
    assert "mkdir -m 700 DIR" in str(refused.value)
    # Above the folder too, unless it is sticky (as /tmp is: only an entry's owner may rename it).
    with pytest.raises(PermissionError, match="can be written by others"):
        private_directory(str(shared / "job"), "--state-dir")
    shared.chmod(0o1777)
    private_directory(str(shared / "job"), "--state-dir")


def test_a_link_on_the_way_is_followed_and_checked(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert private_directory(str(tmp_path / "link" / "job"), "--state-dir") == str(tmp_path / "link" / "job")
    assert (tmp_path / "real" / "job").is_dir()
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    (tmp_path / "to_open").symlink_to(open_dir)
    with pytest.raises(PermissionError, match="can be written by others"):
        private_directory(str(tmp_path / "to_open"), "--state-dir")


@as_root
def test_a_folder_another_user_made_first_is_refused(shared: Path) -> None:
    """The old default, /tmp/tf_adasum_elastic, was used as another user had made it (0777): they could
    read every commit and replace the ones the next group unpickles."""
    tmp_path = shared
    squatted = tmp_path / "tf_adasum_elastic"
    as_nobody(lambda: os.mkdir(squatted, 0o777) or os.chmod(squatted, 0o777))
    with pytest.raises(PermissionError, match=r"owned by uid 65534 \(nobody\)"):
        private_directory(str(squatted / "123-456"), "--state-dir")
    assert not (squatted / "123-456").exists()
    # Owned by another user, however closed.
    as_nobody(lambda: os.mkdir(tmp_path / "theirs", 0o700))
    with pytest.raises(PermissionError, match=r"theirs is a folder owned by uid 65534"):
        private_directory(str(tmp_path / "theirs"), "--output-filename")
    # Another user's link in a sticky folder: they may point it anywhere later.
    as_nobody(lambda: os.symlink(tmp_path / "mine", tmp_path / "their_link"))
    with pytest.raises(PermissionError, match=r"their_link is a link owned by uid 65534"):
        private_directory(str(tmp_path / "their_link"), "--state-dir")


def test_a_file_is_written_whole_private_and_over_a_link_not_through_it(tmp_path: Path) -> None:
    target = tmp_path / "commits.pkl"
    write_private(str(target), b"first")
    assert target.read_bytes() == b"first" and stat.S_IMODE(target.stat().st_mode) == 0o600
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    target.unlink()
    target.symlink_to(victim)
    write_private(str(target), b"second")
    assert victim.read_bytes() == b"untouched" and not target.is_symlink()
    assert read_private(str(target)) == b"second"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")] == []


def test_a_file_is_read_only_where_it_lies_and_only_if_no_one_else_could_write_it(tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(PermissionError, match="is a link"):
        read_private(str(tmp_path / "link"))
    (tmp_path / "real").chmod(0o666)
    with pytest.raises(PermissionError, match="that no one else can write"):
        read_private(str(tmp_path / "real"))
    with pytest.raises(FileNotFoundError):
        read_private(str(tmp_path / "missing"))


@as_root
def test_another_users_file_is_not_read(shared: Path) -> None:
    tmp_path = shared
    as_nobody(lambda: (tmp_path / "planted.pkl").write_bytes(b"cos\nsystem\n(S'id'\ntR."))
    with pytest.raises(PermissionError, match=r"owned by uid 65534 \(nobody\)"):
        read_private(str(tmp_path / "planted.pkl"))
