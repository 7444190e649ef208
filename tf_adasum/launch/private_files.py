"""A job's files, private to its user: folders that no other user owns or can write (nor any folder
above them), files of mode 0600 written whole or not at all and made durable, and read without
following a link. No TensorFlow here.

The rule is ssh's StrictModes: another user who can write a folder on the path can rename what lies in
it and put their own in its place, so each folder on the way, and each link, must belong to this user or
to root, and a folder others can write must be sticky (as /tmp is), where only an entry's owner may
rename it.
"""

from __future__ import annotations

import os
import stat
import tempfile

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
_MAX_LINKS = 40


def _who(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _refuse(path: str, given: str, why: str, what: str) -> PermissionError:
    me = os.geteuid()
    return PermissionError(
        f"{what} {given}: {path} {why}, so another user could read or replace this job's files. "
        f"Give a folder that only you ({_who(me)}) own and can write, under folders that are yours or "
        "root's (mkdir -m 700 DIR; chmod go-w on a folder of yours that others can write), or leave "
        "the option out for a new private folder"
    )


def private_directory(path: str, what: str) -> str:
    """`path` as a folder this job may keep its files in: each missing folder is made (mode 0700), and
    every folder and link on the way checked (see the module's doc). Returns the absolute path.

    Raises:
        PermissionError: a folder or link on the way belongs to another user, or another user can write
            a folder on the way (not sticky) or the folder itself; `what` names the option it came from.
        NotADirectoryError: something on the way is not a folder.
    """
    me = os.geteuid()
    absolute = os.path.abspath(path)
    parts = [p for p in absolute.split(os.sep) if p]
    current, links = os.sep, 0
    while parts:
        name = parts.pop(0)
        if name == ".":
            continue
        if name == "..":
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, name)
        try:
            info = os.lstat(candidate)
        except FileNotFoundError:
            try:
                os.mkdir(candidate, 0o700)
            except FileExistsError:
                pass  # made meanwhile: checked below like any other
            info = os.lstat(candidate)
        if info.st_uid not in (me, 0):
            kind = "is a link" if stat.S_ISLNK(info.st_mode) else "is a folder"
            raise _refuse(candidate, path, f"{kind} owned by {_who(info.st_uid)}", what)
        if stat.S_ISLNK(info.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise _refuse(candidate, path, f"leads through more than {_MAX_LINKS} links", what)
            target = os.readlink(candidate)
            parts = [p for p in target.split(os.sep) if p] + parts
            if os.path.isabs(target):
                current = os.sep
            continue
        if not stat.S_ISDIR(info.st_mode):
            raise NotADirectoryError(f"{what} {path}: {candidate} is not a folder")
        last = not parts
        if info.st_mode & _WRITABLE_BY_OTHERS and (last or not info.st_mode & stat.S_ISVTX):
            raise _refuse(
                candidate, path, f"can be written by others (mode {stat.S_IMODE(info.st_mode):o})", what
            )
        if last and info.st_uid != me:
            raise _refuse(candidate, path, f"is owned by {_who(info.st_uid)}", what)
        current = candidate
    return absolute


def write_private(path: str, data: bytes) -> None:
    """Writes `data` to `path` (mode 0600) whole or not at all: into a new file beside it, flushed to
    the disk, then renamed over `path`, and the folder flushed, so that a crash leaves the old file or
    the new one, never part of one. A link at `path` is replaced, never followed."""
    folder, name = os.path.split(os.path.abspath(path))
    fd, partial = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".partial")  # 0600, O_EXCL
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        try:
            os.unlink(partial)
        except FileNotFoundError:
            pass
        raise
    directory = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def read_private(path: str) -> bytes:
    """The bytes of the file at `path`, which must be a file of this user's that no one else can write;
    a link is not followed.

    Raises:
        PermissionError: `path` is a link, or not this user's, or others can write it.
        FileNotFoundError: there is no such file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as error:
        if os.path.islink(path):
            raise PermissionError(f"{path} is a link: a job's file is read only where it lies") from error
        raise
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise PermissionError(f"{path} is not a plain file")
        if info.st_uid != os.geteuid() or info.st_mode & _WRITABLE_BY_OTHERS:
            raise PermissionError(
                f"{path} is owned by {_who(info.st_uid)} with mode {stat.S_IMODE(info.st_mode):o}: expected "
                f"a file of yours ({_who(os.geteuid())}) that no one else can write"
            )
        return f.read()


def open_private(path: str) -> int:
    """A new or emptied file at `path` for writing (mode 0600 when made), its descriptor; a link there is
    refused, not followed."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
