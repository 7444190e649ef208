"""The elastic launcher's own decisions, with children that import nothing heavy (no warm processes:
--standbys 0): its folders, its discovery, its exit codes and its refusals. tests/test_elastic.py runs
real training jobs under it."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.support.processes import ROOT
from tests.support.users import as_nobody, as_root
from tf_adasum.launch.elastic.commits import KEY_FILE
from tf_adasum.launch.secret import new_secret, seal

CHILD = """
import json, os, sys, time
rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
behaviour = sys.argv[1]
if behaviour == "finish_then_lose" and rank == 1:
    time.sleep(0.5)
    sys.exit(3)
if behaviour == "sleep":
    time.sleep(60)
"""


def elastic(
    tmp_path: Path, *flags: str, behaviour: str = "exit", timeout: float = 60
) -> tuple[int, str, float]:
    """`python -m tf_adasum.run --elastic --standbys 0 FLAGS child.py BEHAVIOUR`: its exit code, its
    output and its seconds."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    command = [
        sys.executable,
        "-m",
        "tf_adasum.run",
        "--elastic",
        "--standbys",
        "0",
        *flags,
        str(script),
        behaviour,
    ]
    started = time.monotonic()
    done = subprocess.run(
        command, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def test_a_job_whose_ranks_did_not_all_finish_fails(tmp_path: Path) -> None:
    """Rank 0 returns, rank 1 is lost: the job did not finish on every process, and says so (it exited
    0, where Horovod's fails)."""
    code, log, _ = elastic(
        tmp_path, "-np", "2", "--state-dir", str(tmp_path / "state"), behaviour="finish_then_lose"
    )
    assert code == 3, log
    assert (
        "rank(s) [0] finished training, but not every rank did: rank 1 (w1@127.0.0.1) lost: exited with 3"
        in log
    )


def test_the_default_state_folder_is_new_private_and_named(tmp_path: Path) -> None:
    code, log, _ = elastic(tmp_path, "-np", "1")
    assert code == 0, log
    (folder,) = re.findall(r"the job's state folder: (\S+)", log)
    try:
        assert Path(folder).stat().st_mode & 0o777 == 0o700
        assert (
            os.path.basename(folder).startswith("tf_adasum_elastic-") and len(os.path.basename(folder)) > 20
        )
        assert (Path(folder) / "job" / KEY_FILE).stat().st_mode & 0o777 == 0o600
    finally:
        subprocess.run(["rm", "-rf", folder], check=True)


@as_root
def test_a_state_folder_another_user_can_write_is_refused_before_anything_starts(shared: Path) -> None:
    as_nobody(
        lambda: os.mkdir(shared / "tf_adasum_elastic", 0o777) or os.chmod(shared / "tf_adasum_elastic", 0o777)
    )
    state = shared / "tf_adasum_elastic" / "job1"
    code, log, _ = elastic(shared, "-np", "1", "--state-dir", str(state))
    assert code == 1, log
    assert (
        f"--state-dir {state}: {shared / 'tf_adasum_elastic'} is a folder owned by uid 65534 (nobody)" in log
    )
    assert "Traceback" not in log and not state.exists()


def test_a_resumed_commit_that_was_altered_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    """--resume-from reads an earlier job's commits under that job's key: one replaced by a pickle that
    would run code is refused before anything unpickles it, and no process starts."""
    group = tmp_path / "old" / "job" / "group0"
    group.mkdir(parents=True)
    key = new_secret()
    (tmp_path / "old" / "job" / KEY_FILE).write_text(key)
    (group / "rank0-w0.pkl").write_bytes(seal(key, pickle.dumps({1: "fine"})))
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.mkdir, (str(marker),))

    (group / "rank1-w1.pkl").write_bytes(seal(new_secret(), pickle.dumps(Payload())))
    for path in (tmp_path / "old", tmp_path / "old" / "job", group):
        path.chmod(0o700)
    code, log, _ = elastic(
        tmp_path, "-np", "2", "--resume-from", str(group), "--state-dir", str(tmp_path / "new")
    )
    assert code == 1, log
    assert f"{group / 'rank1-w1.pkl'} was not written under this job's key" in log, log
    assert not marker.exists() and not (tmp_path / "new" / "group0").exists()


DISCOVERY = """#!/bin/sh
# The first run answers; every later one hangs, with a child of its own.
if [ -e "{ran}" ]; then sleep 300 & echo $! > "{child}"; wait; fi
touch "{ran}"
echo 127.0.0.1:2
"""


def test_a_discovery_script_that_hangs_never_holds_the_launcher(tmp_path: Path) -> None:
    """It ran on the launcher's loop (asked for more slots while the group is below --max-np), for its
    30 s timeout, past the job's --timeout, and its child was left running. Now it runs apart: the job's
    --timeout holds, and the script's process group ends."""
    script = tmp_path / "discover.sh"
    script.write_text(DISCOVERY.format(ran=tmp_path / "ran", child=tmp_path / "child.pid"))
    script.chmod(0o755)
    code, log, seconds = elastic(
        tmp_path, "-np", "2", "--max-np", "3", "--host-discovery-script", str(script),
        "--host-discovery-interval", "0.2",
        "--timeout", "4", "--state-dir", str(tmp_path / "state"), behaviour="sleep",
    )  # fmt: skip
    assert code == 124, log
    assert seconds < 15, (seconds, log)
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists(), "the hanging script's child was left running"


def test_a_discovery_line_that_is_not_a_host_is_refused_with_its_text(tmp_path: Path) -> None:
    """A stray "Using cached credentials" was ssh'd to as a host."""
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho Using cached credentials\necho 127.0.0.1:2\n")
    script.chmod(0o755)
    code, log, _ = elastic(
        tmp_path, "-np", "2", "--host-discovery-script", str(script), "--elastic-timeout", "2",
        "--state-dir", str(tmp_path / "state"),
    )  # fmt: skip
    assert code == 1, log
    assert "got line 1: 'Using cached credentials'" in log, log
    assert "0 worker(s) available, fewer than --min-np 2" in log, log
