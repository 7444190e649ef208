"""The elastic launcher's services and its pool of warm processes, each on its own
(tf_adasum/launch/protocol.py, launch/elastic/pool.py, launch/relay.py, elastic/forkserver.py): they
answer only holders of the job's key, listen no wider than asked, and a warm process runs a script as
a cold one would."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.services import flooded
from tf_adasum.launch.elastic.pool import ENV_FORKSERVER, Pool
from tf_adasum.launch.protocol import (
    ENV_DRIVER,
    ENV_GENERATION,
    NoticeBoard,
    SlotNotices,
    watch_for_end,
)
from tf_adasum.launch.secret import ENV_SECRET, AuthenticationError, Channel, new_secret
from tf_adasum.launch.service import ask

# Times how soon a watcher hears: `make test` runs it after the rest, alone on the machine.
pytestmark = pytest.mark.alone


def _ask(board: NoticeBoard, request: dict[str, object], key: str | None = None) -> dict[str, object]:
    return ask(board.address, board.key if key is None else key, request, timeout=30, max_blob=1 << 20)[0]


def _stranger(address: str, sent: bytes) -> bytes:
    """What a stranger that sends `sent` (no proof of the key) reads after the service's greeting and
    nonce, until the service closes the connection (a reset too: it leaves the rest unread)."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as stranger:
        greeting = b""
        while len(greeting) < len(b"tf_adasum-1\n") + 16:
            greeting += stranger.recv(64)
        assert greeting.startswith(b"tf_adasum-1\n"), greeting
        stranger.sendall(sent)
        received = b""
        try:
            while chunk := stranger.recv(4096):
                received += chunk
        except ConnectionResetError:
            pass
    return received


@pytest.fixture
def board(tmp_path: Path):  # type: ignore[no-untyped-def]
    board = NoticeBoard("127.0.0.1", new_secret(), str(tmp_path / "job"))
    yield board
    board.close()


def test_the_notice_service_answers_the_jobs_key_alone(board: NoticeBoard) -> None:
    assert board.address.startswith("127.0.0.1:"), "it listens where the workers reach it, no wider"
    with pytest.raises(AuthenticationError, match="it holds another key"):
        _ask(board, {"ask": "updates", "generation": 0}, key=new_secret())
    # A stranger gets the greeting and a nonce, then the door shut: no answer, whatever it sends.
    request = b"GET /updates?generation=0 HTTP/1.1\r\nX-TF-Adasum-Secret: guess\r\n\r\n" + bytes(64)
    assert _stranger(board.address, request) == b""
    assert _ask(board, {"ask": "updates", "generation": 0}) == {"notice": 0}
    board.post(0)
    assert int(str(_ask(board, {"ask": "updates", "generation": 0})["notice"])) > 0
    assert _ask(board, {"ask": "updates", "generation": 1}) == {"notice": 0}
    assert "error" in _ask(board, {"ask": "updates", "generation": "0"})


def test_a_process_refuses_an_impostor_of_the_launcher(board: NoticeBoard, tmp_path: Path) -> None:
    """Replies are authenticated too: a service that does not hold the key (another user's, on a port the
    launcher once had) is refused before the process sends or reads anything; a reply that was altered on
    the way is refused before it is read as an answer."""
    impostor = NoticeBoard("127.0.0.1", new_secret(), str(tmp_path / "other"))
    try:
        with pytest.raises(AuthenticationError, match="not this job's service"):
            ask(impostor.address, board.key, {"ask": "state", "path": "x"}, timeout=10)
    finally:
        impostor.close()


def test_rank_0_hears_a_notice_of_added_slots_as_soon_as_it_is_posted(board: NoticeBoard) -> None:
    notices = {group: SlotNotices(board.address, group, board.key) for group in (1, 2, 3)}
    time.sleep(1.0)
    board.post(0)  # another group's notice is not theirs
    time.sleep(0.2)
    assert all(n.latest == 0 for n in notices.values()), "no notice before one is posted"
    heard = {}
    for group, n in notices.items():  # posted at three phases of any period a poll would have
        posted = time.monotonic()
        board.post(group)
        while n.latest == 0 and time.monotonic() < posted + 10:
            time.sleep(0.005)
        heard[group] = time.monotonic() - posted
        assert n.latest == board.notice[group]
        time.sleep(0.3)
    assert max(heard.values()) < 0.2, f"rank 0 heard the notices {heard} s after their posting, not at once"


def test_a_groups_end_is_held_until_it_comes_then_told_to_each_of_its_processes(
    board: NoticeBoard, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_DRIVER, board.address)
    monkeypatch.setenv(ENV_SECRET, board.key)
    monkeypatch.setenv(ENV_GENERATION, "1")
    told: list[tuple[str, float]] = []
    watch_for_end(lambda reason: told.append((reason, time.monotonic())))
    held = threading.Thread(
        target=lambda: told.append((str(_ask(board, {"ask": "ended", "generation": 1})["reason"]), 0))
    )
    held.start()
    time.sleep(1.0)
    assert not told, "nothing is told before the group ends"
    board.end(0, "an earlier group's end")  # told to that group's processes alone
    time.sleep(0.5)
    assert not told
    ended = time.monotonic()
    board.end(1, "rank 2 (w2@127.0.0.1) lost: killed by SIGKILL")
    board.end(1, "rank 0 (w0@127.0.0.1) restart")  # the first reason stays
    held.join(10)
    deadline = time.monotonic() + 10
    while len(told) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(reason for reason, _ in told) == ["rank 2 (w2@127.0.0.1) lost: killed by SIGKILL"] * 2
    assert max(at for _, at in told) - ended < 1.0, "the watcher hears at once, not at its next poll"
    assert _ask(board, {"ask": "ended", "generation": 1}) == {
        "reason": "rank 2 (w2@127.0.0.1) lost: killed by SIGKILL"
    }


def test_the_launchers_copy_of_a_commit_is_served_once_copied_and_nothing_outside_its_folder(
    board: NoticeBoard, tmp_path: Path
) -> None:
    copy = tmp_path / "job" / "group0" / "rank1-w1.pkl"
    copy.parent.mkdir(parents=True)
    board.copying(str(copy))
    answers: list[tuple[dict[str, object], bytes]] = []

    def state(path: Path) -> tuple[dict[str, object], bytes]:
        return ask(board.address, board.key, {"ask": "state", "path": str(path)}, timeout=30, max_blob=64)

    asked = threading.Thread(target=lambda: answers.append(state(copy)))
    asked.start()
    time.sleep(0.5)
    assert not answers, "a copy still being made is not served"
    copy.write_bytes(b"commits")
    board.copied(str(copy))
    asked.join(30)
    assert answers == [({"found": True}, b"commits")]
    (tmp_path / "secret.txt").write_text("not the job's")
    assert state(tmp_path / "secret.txt") == ({"found": False}, b"")
    assert state(tmp_path / "job" / ".." / "secret.txt") == ({"found": False}, b"")
    os.symlink(tmp_path / "secret.txt", copy.parent / "rank2-w2.pkl")  # a link in the folder: not followed
    assert state(copy.parent / "rank2-w2.pkl") == ({"found": False}, b"")


CHILD = """
import json, os, sys
json.dump({"argv": sys.argv, "cwd": os.getcwd(), "setting": os.environ.get("A_SETTING"),
           "warm": "tf_adasum.launch.elastic.pool" in sys.modules, "name": __name__},
          open(os.environ["OUT"], "w"))
sys.exit(int(os.environ.get("CODE", "0")))
"""


def _wait_ready(pool: Pool, host: str, count: int) -> None:
    deadline = time.monotonic() + 180
    while pool.ready_on(host) < count:
        assert time.monotonic() < deadline, "warm processes never got ready"
        pool.reap()
        time.sleep(0.2)


@pytest.mark.multiprocess
def test_a_warm_process_runs_a_script_as_a_cold_one_would(tmp_path: Path) -> None:
    said: list[str] = []
    pool = Pool("127.0.0.1", new_secret(), 2, "unused", dict(os.environ), said.append)
    try:
        pool.fill({"127.0.0.1": 2})
        _wait_ready(pool, "127.0.0.1", 2)
        # Anyone without the key is shut out; the pool's processes stay as they were.
        assert flooded(pool.address) < 16 << 20
        assert pool.ready_on("127.0.0.1") == 2

        script = tmp_path / "child.py"
        script.write_text(CHILD)
        standby = pool.take("127.0.0.1")
        assert standby is not None
        env = dict(os.environ, OUT=str(tmp_path / "out.json"), A_SETTING="given", CODE="3")
        process = pool.assign(standby, env, [sys.executable, str(script), "first", "second"])
        assert process.wait(60) == 3
        seen = json.loads((tmp_path / "out.json").read_text())
        assert seen == {
            "argv": [str(script), "first", "second"],
            "cwd": os.getcwd(),
            "setting": "given",
            "warm": True,
            "name": "__main__",
        }

        # A warm process that dies while it waits is said and replaced.
        waiting = pool.take("127.0.0.1")
        assert waiting is not None
        pool.waiting.append(waiting)
        waiting.process.kill()
        waiting.process.wait(30)
        pool.reap()
        assert any("ended while it waited" in line for line in said), said
        pool.fill({"127.0.0.1": 2})
        _wait_ready(pool, "127.0.0.1", 2)
    finally:
        pool.close()
    assert all(s.process.poll() is not None for s in pool.waiting)


FORKED = """
import json, os, signal, sys
import numpy as np
json.dump({"pid": os.getpid(), "parent": os.getppid(), "draw": float(np.random.random()),
           "tensorflow": "tensorflow" in sys.modules}, open(os.environ["OUT"], "w"))
if os.environ.get("THEN") == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if os.environ.get("THEN") == "stop":
    os.kill(os.getpid(), signal.SIGSTOP)
if os.environ.get("THEN") == "sleep":
    import time
    time.sleep(120)
"""


def _forks_of(pid: int) -> set[int]:
    return {int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def _gone(pid: int, within: float) -> bool:
    """Whether process `pid` ends (reaped or not) within `within` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _run(pool: Pool, out: Path, then: str = "") -> subprocess.Popen[bytes]:
    standby = pool.take("127.0.0.1")
    assert standby is not None
    script = out.with_suffix(".py")
    script.write_text(FORKED)
    env = dict(os.environ, OUT=str(out), THEN=then)
    return pool.assign(standby, env, [sys.executable, str(script)])


def _written(out: Path) -> dict[str, object]:
    deadline = time.monotonic() + 60
    while not out.exists():
        assert time.monotonic() < deadline, f"{out} never written"
        time.sleep(0.05)
    time.sleep(0.2)
    return dict(json.loads(out.read_text()))


def _silent_stranger_of_another_user(address: str) -> bytes:
    """What a process of user nobody reads within 5 s from `address`, having sent nothing (as root)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: user nobody, connects, sends nothing, reports what it read
        try:
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stranger:
                stranger.connect(address)
                stranger.settimeout(5)
                try:
                    got = b"closed:" + stranger.recv(1)
                except TimeoutError:
                    got = b"timed out"
            os.write(write, got)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as report:
        said = report.read()
    os.waitpid(pid, 0)
    assert said.startswith(b"closed:"), said
    return said[len(b"closed:") :]


@pytest.mark.multiprocess
def test_warm_processes_are_forks_of_one_server_that_stand_for_a_process_of_the_launchers(
    tmp_path: Path,
) -> None:
    said: list[str] = []
    pool = Pool("127.0.0.1", new_secret(), 3, "unused", dict(os.environ), said.append)
    try:
        pool.fill({"127.0.0.1": 3})
        _wait_ready(pool, "127.0.0.1", 3)
        server = pool.forkservers["127.0.0.1"].process.pid
        assert len(_forks_of(server)) == 3

        # Two places: each a fork of the one server, TensorFlow in, numpy's draws its own.
        a, b = _run(pool, tmp_path / "a.json"), _run(pool, tmp_path / "b.json")
        assert (a.wait(60), b.wait(60)) == (0, 0)
        outs = [_written(tmp_path / "a.json"), _written(tmp_path / "b.json")]
        assert [o["parent"] for o in outs] == [server, server] and all(o["tensorflow"] for o in outs)
        assert outs[0]["draw"] != outs[1]["draw"]

        # The pool refills from the server in well under the seconds an import takes.
        started = time.monotonic()
        pool.fill({"127.0.0.1": 3})
        _wait_ready(pool, "127.0.0.1", 3)
        assert time.monotonic() - started < 5

        # A fork that dies by a signal: its relay, the launcher's process, ends by the same signal.
        assert _run(pool, tmp_path / "c.json", then="kill").wait(60) == -signal.SIGKILL

        # The launcher kills a relay (its process hung): the fork ends too, even a stopped one.
        relay = _run(pool, tmp_path / "d.json", then="stop")
        fork = int(str(_written(tmp_path / "d.json")["pid"]))
        os.killpg(relay.pid, signal.SIGKILL)
        relay.wait(30)
        assert _gone(fork, within=5)

        # Nobody else gets a fork: a request without the job's secret is closed, nothing forked.
        forks = _forks_of(server)
        name = "\0" + pool.forkserver_names["127.0.0.1"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stranger:
            stranger.connect(name)
            stranger.settimeout(10)
            assert stranger.recv(64).startswith(b"tf_adasum-1\n")
            socket.send_fds(stranger, [bytes(48)], [0, 1, 2])  # streams, but no proof of the key
            assert stranger.recv(1) == b""
        # Another user's connection is closed before the server reads anything (it would otherwise hold
        # the server for the read's timeout): here, one that sends nothing.
        if os.getuid() == 0:
            assert _silent_stranger_of_another_user(name) == b""
        assert _forks_of(server) <= forks
    finally:
        pool.close()
    assert _gone(server, within=10)
    assert not said, said


@pytest.mark.multiprocess
def test_a_fork_server_that_dies_is_said_and_replaced_and_a_relay_without_one_imports_itself(
    tmp_path: Path,
) -> None:
    said: list[str] = []
    pool = Pool("127.0.0.1", new_secret(), 1, "unused", dict(os.environ), said.append)
    try:
        pool.fill({"127.0.0.1": 1})
        _wait_ready(pool, "127.0.0.1", 1)
        # The server dies: its waiting forks go with it (their exit statuses would be lost), it is said,
        # and the next fill starts another.
        first = pool.forkservers["127.0.0.1"].process
        first_name = pool.forkserver_names["127.0.0.1"]
        first.kill()
        first.wait(30)
        pool.reap()
        assert any("the fork server on 127.0.0.1 ended (exit code -9" in line for line in said), said
        assert pool.ready_on("127.0.0.1") == 0
        pool.fill({"127.0.0.1": 1})
        _wait_ready(pool, "127.0.0.1", 1)
        assert pool.forkservers["127.0.0.1"].process.pid != first.pid
        # A fresh name no one could have bound before it (128 random bits): not the dead one's.
        name = pool.forkserver_names["127.0.0.1"]
        assert name != first_name and len(name.rsplit("-", 1)[1]) == 32
        assert _run(pool, tmp_path / "a.json").wait(60) == 0

        # The server dies while a fork of it runs: no one could pass on the fork's exit status, so its
        # relay kills it and ends at once, saying so (it waited for the --timeout, or reported a fork
        # that still ran as ended).
        pool.fill({"127.0.0.1": 1})
        _wait_ready(pool, "127.0.0.1", 1)
        relay = _run(pool, tmp_path / "lost.json", then="sleep")
        fork = int(str(_written(tmp_path / "lost.json")["pid"]))
        os.kill(pool.forkservers["127.0.0.1"].process.pid, signal.SIGKILL)
        _, error = relay.communicate(timeout=10)
        assert relay.returncode == 1, error.decode(errors="replace")[-2000:]
        assert b"the fork server (pid" in error and b"this member of the group is lost" in error
        assert _gone(fork, within=5)
        pool.reap()

        # A relay told of no fork server: a warm process of its own, which says so, runs the script.
        environment = pool._environment
        pool._environment = lambda host: {**environment(host), ENV_FORKSERVER: ""}  # type: ignore[method-assign]
        pool.fill({"127.0.0.1": 1})
        _wait_ready(pool, "127.0.0.1", 1)
        process = _run(pool, tmp_path / "b.json")
        _, error = process.communicate(timeout=60)
        assert process.returncode == 0
        assert _written(tmp_path / "b.json")["parent"] == os.getpid()
        assert b"no fork server is named; this warm process imports TensorFlow itself" in error
    finally:
        pool.close()


class _Refused(Exception):
    pass


def _refuse(why: str) -> None:
    raise _Refused(why)


def _squatter(name: str, report: int, ready: int) -> None:
    """In a forked child: binds the abstract socket `name`, takes one connection and writes to `report`
    what came over it within 3 s: bytes and passed descriptors."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(1)
    os.write(ready, b"1")
    listener.settimeout(10)
    connection, _ = listener.accept()
    connection.settimeout(3)
    received, fds = 0, 0
    try:
        while True:
            data, ancillary, _, _ = connection.recvmsg(4096, socket.CMSG_SPACE(16 * 4))
            received += len(data)
            fds += sum(len(item[2]) // 4 for item in ancillary)
            if not data:
                break
    except OSError:
        pass
    os.write(report, f"{received} {fds}".encode())


def test_a_relay_sends_nothing_to_a_fork_server_name_that_another_user_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A name that another user bound (after the job's fork server died: it was visible in
    /proc/net/unix and reused) got the relay's streams and its environment with the job's key. Now the
    relay checks the server's user first, and sends nothing to another's."""
    if os.getuid() != 0:
        pytest.skip("becoming another user (nobody) needs root; CI runs as root")
    from tf_adasum.launch import relay as elastic_relay

    name = f"tf_adasum-{new_secret()[:32]}"
    report_read, report_write = os.pipe()
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(65534)
            os.setuid(65534)
            _squatter(name, report_write, ready_write)
        finally:
            os._exit(0)
    os.close(report_write)
    os.close(ready_write)
    assert os.read(ready_read, 1) == b"1"
    monkeypatch.setenv(ENV_SECRET, new_secret())
    monkeypatch.setattr(elastic_relay, "_import_it_here", _refuse)
    with pytest.raises(_Refused, match=r"held by uid 65534, not by this job's user \(0\)"):
        elastic_relay._fork(name)
    with os.fdopen(report_read, "rb") as report:
        got = report.read().decode()
    os.waitpid(pid, 0)
    os.close(ready_read)
    assert got == "0 0", f"the squatter received (bytes, descriptors) {got}"


def test_a_relay_sends_nothing_to_a_fork_server_that_does_not_hold_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same user's socket, answered by something without the job's key: refused at the handshake,
    with only the relay's nonce and proof sent (no streams, no environment)."""
    from tf_adasum.launch import relay as elastic_relay

    name = f"tf_adasum-{new_secret()[:32]}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(1)
    received: list[tuple[int, int]] = []

    def impostor() -> None:
        connection, _ = listener.accept()
        try:
            Channel.accept(connection, new_secret())  # another key: the relay's proof fails here
        except AuthenticationError:
            connection.sendall(bytes(32))  # answers with a proof anyway
        connection.settimeout(3)
        data, ancillary, _, _ = connection.recvmsg(4096, socket.CMSG_SPACE(16 * 4))
        received.append((len(data), sum(len(item[2]) // 4 for item in ancillary)))
        connection.close()

    thread = threading.Thread(target=impostor)
    thread.start()
    monkeypatch.setenv(ENV_SECRET, new_secret())
    monkeypatch.setattr(elastic_relay, "_import_it_here", _refuse)
    try:
        with pytest.raises(_Refused, match=r"the fork server refused or ended \(.*not this job's service"):
            elastic_relay._fork(name)
    finally:
        thread.join(10)
        listener.close()
    assert received == [(0, 0)], "nothing after the proof: no streams, no environment"


STARTER = """
import json, os, sys, time
from pathlib import Path
import tensorflow as tf
import tf_adasum
out, rank = Path(sys.argv[1]), int(sys.argv[2])
(out / f"imported{rank}").touch()
deadline = time.monotonic() + 120
while len(list(out.glob("imported*"))) < 3 and time.monotonic() < deadline:
    time.sleep(0.005)
if rank == 0:
    time.sleep(0.3)  # worker 0, where the coordination service runs, a little late
start = time.time()
tf_adasum.init()
(out / f"init{rank}.json").write_text(json.dumps({"start": start, "end": time.time()}))
# Exit only once every worker has its start-up gather: one that left first would reset the connection
# another still read its part from (seen once in CI: "Connection reset by peer" at start-up).
while len(list(out.glob("init*.json"))) < 3 and time.monotonic() < deadline + 60:
    time.sleep(0.005)
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.multiprocess
def test_workers_that_start_together_do_not_wait_out_grpcs_reconnect_backoff(tmp_path: Path) -> None:
    """A group's processes start at once under the elastic launcher (its warm processes). A worker that
    asked worker 0's coordination service before it listened used to wait for gRPC's reconnect backoff
    (about 1 s), and every worker with it; now each waits for worker 0 to listen, then connects."""
    script = tmp_path / "starter.py"
    script.write_text(STARTER)
    ports = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    processes = []
    for rank in range(3):
        config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": rank}})
        env = dict(os.environ, TF_CONFIG=config, TF_CPP_MIN_LOG_LEVEL="3")
        env.pop("TF_ADASUM_LAUNCHER", None)
        command = [sys.executable, str(script), str(tmp_path), str(rank)]
        processes.append(subprocess.Popen(command, env=env, stderr=subprocess.PIPE))
    for process in processes:
        _, error = process.communicate(timeout=180)
        assert process.returncode == 0, error.decode(errors="replace")[-3000:]
    times = [json.loads((tmp_path / f"init{rank}.json").read_text()) for rank in range(3)]
    # From worker 0's start to the last worker's engine: the backoff's 1 s (0.8-1.2 with its jitter) no
    # longer in it.
    assert max(t["end"] for t in times) - times[0]["start"] < 0.6, times
