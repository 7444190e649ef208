"""The elastic launcher's copies of the job's commits, on its own host (STATE_DIR/job): the job's key
beside them, a survivor's commits copied from its host and checked under the key before they are kept,
and --resume-from's commits read back under their own job's key. No TensorFlow here: nothing is
unpickled, only checked.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable, Mapping

from tf_adasum.launch.hosts import LOCAL_HOSTS, start
from tf_adasum.launch.private_files import private_directory, read_private, write_private
from tf_adasum.launch.protocol import NoticeBoard
from tf_adasum.launch.secret import seal, unseal

# The job's key, beside the launcher's copies of the commits (STATE_DIR/job/KEY_FILE): what reads them
# again, with --resume-from, checks them under it.
KEY_FILE = "key"


def job_folder(state_dir: str, secret: str) -> str:
    """STATE_DIR/job, made private, with the job's key in it; returns its path."""
    folder = private_directory(os.path.join(state_dir, "job"), "--state-dir")
    write_private(os.path.join(folder, KEY_FILE), secret.encode())
    return folder


def read_key(job: str) -> str:
    """The key of the job whose STATE_DIR/job is `job`."""
    return read_private(os.path.join(job, KEY_FILE)).decode()


def copy_commits(host: str, path: str, copy: str, secret: str, env: Mapping[str, str], agent: str) -> None:
    """Copies the commits at `path` on `host` (through the agent if it is not this one) to `copy`, here,
    once they check under the job's key `secret`.

    Raises:
        OSError: the file could not be read or written; AuthenticationError (one of these) where it was
            not sealed under the key.
    """
    if host in LOCAL_HOSTS:
        data = read_private(path)
    else:
        read = start(host, ["/bin/cat", path], dict(env), agent)
        data, error = read.communicate(timeout=600)
        if read.returncode != 0:
            raise OSError(error.decode(errors="replace")[-300:])
    unseal(secret, data, f"{path} on {host}")  # none kept unchecked
    write_private(copy, data)


def keep_copy(
    notices: NoticeBoard,
    host: str,
    path: str,
    copy: str,
    secret: str,
    env: Mapping[str, str],
    agent: str,
    say: Callable[[str], None],
) -> None:
    """Starts copy_commits() in a thread; the launcher's services serve the copy once it is done, to a
    process whose host lacks the file (elastic_protocol.fetch_state). A copy that fails is said."""
    private_directory(os.path.dirname(copy), "--state-dir")
    notices.copying(copy)

    def run() -> None:
        try:
            copy_commits(host, path, copy, secret, env, agent)
        except (OSError, subprocess.SubprocessError) as error:  # AuthenticationError among them
            say(f"could not keep a copy of {path} from {host}: {error}")
        finally:
            notices.copied(copy)

    threading.Thread(target=run, daemon=True).start()


def resumed_commits(folder: str) -> dict[str, bytes]:
    """The commits in `folder` (an earlier job's group folder: STATE_DIR/job/group<g>, the launcher's
    copies, or STATE_DIR/group<g>, the processes' own), by file name in rank order, each checked under
    that job's key (STATE_DIR/job/KEY_FILE) and unsealed.

    Raises:
        ValueError: the folder holds no commits, or its job's key is missing.
        AuthenticationError: a commit that is not that job's (altered or replaced).
    """
    folder = private_directory(folder, "--resume-from")
    names = sorted(
        (f for f in os.listdir(folder) if f.startswith("rank") and f.endswith(".pkl")),
        key=lambda f: int(f.split("-")[0][4:]),
    )
    if not names:
        raise ValueError(f"--resume-from {folder}: expected a group's commits (rank<r>-<id>.pkl), found none")
    parent = os.path.dirname(folder)
    jobs = [
        job for job in (parent, os.path.join(parent, "job")) if os.path.exists(os.path.join(job, KEY_FILE))
    ]
    if not jobs:
        raise ValueError(
            f"--resume-from {folder}: no job key beside it ({os.path.join(parent, 'job', KEY_FILE)}), so its "
            "commits cannot be checked: expected STATE_DIR/job/group<g> or STATE_DIR/group<g> of a tf_adasum "
            "elastic job"
        )
    key = read_key(jobs[0])
    paths = [os.path.join(folder, name) for name in names]
    return {name: unseal(key, read_private(path), path) for name, path in zip(names, paths, strict=True)}


def reseal(state_dir: str, resumed: Mapping[str, bytes], secret: str) -> dict[str, str]:
    """resumed_commits()'s commits sealed anew under this job's key `secret`, in STATE_DIR/job/resumed;
    returns each file name's new path."""
    if not resumed:
        return {}
    folder = private_directory(os.path.join(state_dir, "job", "resumed"), "--state-dir")
    paths = {name: os.path.join(folder, name) for name in resumed}
    for name, commits in resumed.items():
        write_private(paths[name], seal(secret, commits))
    return paths
