"""Another user of this host for the tests that need one: nobody (uid 65534), become by a forked
child of a root test process, and a sticky folder both can write in, as /tmp."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

NOBODY = 65534
CHILD_TIMEOUT_SECONDS = 60


as_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="becoming another user (nobody) needs root; CI runs as root"
)


@pytest.fixture
def shared(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A sticky folder every user may write in, as /tmp is, that nobody can reach (tmp_path's folders
    are root's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="tf_adasum-test-", dir="/tmp"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder)


def as_nobody(action: Callable[[], None]) -> None:
    """Runs `action` in a forked child as user nobody; fails if it raised."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + CHILD_TIMEOUT_SECONDS
    while True:  # bounded: a child of a process with TensorFlow's threads can hang (a lock held at fork)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the child as nobody did not end within {CHILD_TIMEOUT_SECONDS} s")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
