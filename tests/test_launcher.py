"""`python -m tf_adasum.run`: every process gets its TF_CONFIG, output lines carry the rank, the first
failure ends everyone (after a grace in which they may report it), the timeout kills everyone. The
children here are tiny scripts that import nothing heavy."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tf_adasum.launch import static
from tf_adasum.launch.hosts import StartError, ephemeral_floor, free_ports, parse_hosts
from tf_adasum.launch.settings import LaunchSettings

CHILD = """
import json, os, sys, time
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
workers = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]
open(os.path.join(sys.argv[1], f"pid{index}"), "w").write(str(os.getpid()))
seen = {k: os.environ.get(k) for k in ("USERS_SETTING", "TF_ADASUM_LAUNCHER")}
json.dump({"cwd": os.getcwd(), **seen}, open(os.path.join(sys.argv[1], f"env{index}.json"), "w"))
print(f"hello from {index} of {len(workers)} at {workers[index]}", flush=True)
behaviour = sys.argv[2]
if behaviour in ("fail", "report") and index == 1:
    sys.exit(3)
if behaviour == "report":  # notices the failure a moment later, reports it, and ends on its own
    while not os.path.exists(os.path.join(sys.argv[1], "pid1")):  # rank 1 has started (and fails)
        time.sleep(0.05)
    time.sleep(1)
    open(os.path.join(sys.argv[1], "reported"), "w").write("lost rank 1")
    sys.exit(4)
if behaviour in ("fail", "hang"):
    time.sleep(60)
"""


def start(tmp_path: Path, behaviour: str, timeout: float | None = None) -> tuple[int, float]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    begin = time.monotonic()
    code = static.launch(
        LaunchSettings(2, [sys.executable, str(script), str(tmp_path), behaviour], timeout=timeout)
    )
    return code, time.monotonic() - begin


def alive(tmp_path: Path, index: int) -> bool:
    try:
        os.kill(int((tmp_path / f"pid{index}").read_text()), 0)
    except ProcessLookupError:
        return False
    return True


def test_every_line_carries_the_rank_and_every_process_its_config(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code, _ = start(tmp_path, "exit")
    lines = capfd.readouterr().out.splitlines()
    assert code == 0
    for index in range(2):
        line = next(x for x in lines if x.startswith(f"[{index}] "))
        assert line.startswith(f"[{index}] hello from {index} of 2 at 127.0.0.1:"), lines


def test_the_first_failure_ends_every_process_with_its_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(static, "GRACE_SECONDS", 2.0)
    code, seconds = start(tmp_path, "fail")
    assert code == 3 and 2 <= seconds < 30, (code, seconds)
    assert not alive(tmp_path, 0)  # the sleeper was killed after the grace, not left behind


def test_the_others_may_report_the_failure_before_they_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(static, "GRACE_SECONDS", 30.0)
    code, seconds = start(tmp_path, "report")
    assert code == 3 and seconds < 20, (code, seconds)  # the first failure's code, without the grace
    assert (tmp_path / "reported").read_text() == "lost rank 1"


def test_the_timeout_kills_everything(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    code, seconds = start(tmp_path, "hang", timeout=3)
    assert code == 124 and seconds < 30, (code, seconds)
    assert "killed all 2 processes after the 3 s timeout" in capfd.readouterr().err
    assert not alive(tmp_path, 0) and not alive(tmp_path, 1)


def test_the_launcher_itself_imports_no_tensorflow(tmp_path: Path) -> None:
    # Python imports the package before it runs `-m tf_adasum.run`; the launcher needs none of it, and
    # importing TensorFlow there cost every launch 5 s of CPU before its first worker started.
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    command = [sys.executable, "-X", "importtime", "-m", "tf_adasum.run", "-np", "1"]
    command += [str(script), str(tmp_path), "ok"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hello from 0 of 1" in done.stdout, done.stdout
    lines = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    imported = [line.rsplit("|", 1)[-1].strip() for line in lines]
    assert "tf_adasum" in imported, imported[-20:]  # the package, whose __init__ stops early
    heavy = [m for m in imported if m.split(".")[0] in ("tensorflow", "keras", "numpy")]
    assert not heavy, heavy[:10]


def test_the_elastic_relay_imports_no_tensorflow_until_it_must() -> None:
    # Every warm process of an elastic job starts as a relay that gets a fork of its host's fork server:
    # it must start in a fraction of a second. Told of no fork server, it becomes a warm process that
    # imports everything itself (the same process, exec'd), and says so first.
    env = {k: v for k, v in os.environ.items() if k != "TF_ADASUM_ELASTIC_FORKSERVER"}
    command = [sys.executable, "-X", "importtime", "-m", "tf_adasum.launch.relay"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False, env=env)
    said = "tf_adasum.launch.relay: no fork server is named; this warm process imports TensorFlow itself"
    assert said in done.stderr, done.stderr[-3000:]
    relay, standby = done.stderr.split(said)
    imported = [
        line.rsplit("|", 1)[-1].strip() for line in relay.splitlines() if line.startswith("import time:")
    ]
    assert "tf_adasum.launch.elastic.pool" in imported, imported[-20:]  # the relay's own imports
    heavy = [m for m in imported if m.split(".")[0] in ("tensorflow", "keras", "numpy")]
    assert not heavy, heavy[:10]
    # Then the same process is the standby, TensorFlow imported, which finds no pool to wait for here.
    assert "elastic/standby.py" in standby, standby[-2000:]
    assert "KeyError: 'TF_ADASUM_ELASTIC_POOL'" in standby, standby[-2000:]


def test_the_ranks_ports_lie_below_the_range_the_kernel_hands_out() -> None:
    """A rank binds its gRPC port seconds after the launcher chose it. A port of the kernel's ephemeral
    range could be taken in between by any process's outgoing connection or bind to port 0 (a CI run
    lost a rank so: "Could not start gRPC server"); below that range only another chooser can."""
    taken = []
    for _ in range(200):  # the kernel's own choices, held, as a busy host's connections hold theirs
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        taken.append(s)
    try:
        ports = free_ports(64)
        held = {s.getsockname()[1] for s in taken}
        assert len(set(ports)) == 64 and not held & set(ports)
        assert all(15000 <= port < ephemeral_floor() for port in ports), ports
        for port in ports:  # each is free
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
    finally:
        for s in taken:
            s.close()


def test_a_host_list_places_ranks_in_order_as_horovodrun() -> None:
    assert parse_hosts("10.0.0.1:2,10.0.0.2:2", 4) == ["10.0.0.1"] * 2 + ["10.0.0.2"] * 2
    assert parse_hosts("a,b,c", 2) == ["a", "b"]  # one slot each by default; the rest unused
    with pytest.raises(ValueError, match=r"has 3 slots for -np 4"):
        parse_hosts("a:1,b:2", 4)
    with pytest.raises(ValueError, match=r"expected host:slots entries .* got 'b:two'"):
        parse_hosts("a:1,b:two", 2)


# An agent in ssh's place that runs the command here, noting which host it was asked for.
AGENT = """
import os, sys
host, line = sys.argv[1], " ".join(sys.argv[2:])
open(os.path.join(os.environ["AGENT_LOG"], host), "w").write(line)
os.execvp("sh", ["sh", "-c", line])
"""


def test_other_hosts_are_started_through_the_agent_with_the_environment(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    script, agent = tmp_path / "child.py", tmp_path / "agent.py"
    script.write_text(CHILD)
    agent.write_text(AGENT)
    monkeypatch.setenv("AGENT_LOG", str(tmp_path))
    monkeypatch.setenv("USERS_SETTING", 'it\'s "quoted" $HOME')
    monkeypatch.chdir(tmp_path)
    command = [sys.executable, str(script), str(tmp_path), "exit"]
    settings = LaunchSettings(3, command, hosts="localhost:1,hostb:2", agent=f"{sys.executable} {agent}")
    code = static.launch(settings)
    lines = capfd.readouterr().out.splitlines()
    assert code == 0, lines
    assert [line.split(" at ")[1].rsplit(":", 1)[0] for line in sorted(lines)] == [
        "localhost",
        *["hostb"] * 2,
    ]
    # localhost ran directly; hostb's two went through the agent, in this directory, with this
    # environment and their own TF_CONFIG, which travelled on stdin: the command line, which the other
    # host's process list shows to every user, holds none of it.
    remote = (tmp_path / "hostb").read_text()
    assert "USERS_SETTING" not in remote and "quoted" not in remote and "TF_CONFIG" not in remote
    for index in range(3):
        seen = json.loads((tmp_path / f"env{index}.json").read_text())
        assert seen == {
            "cwd": str(tmp_path),
            "USERS_SETTING": 'it\'s "quoted" $HOME',
            "TF_ADASUM_LAUNCHER": "1",
        }
    assert not (tmp_path / "localhost").exists()


def test_a_modules_own_flags_after_m_go_to_the_module(tmp_path: Path) -> None:
    """`-m module --flag value` passes --flag to the module, as python -m does; --timeout here is the
    module's, not the launcher's."""
    (tmp_path / "flags_child.py").write_text(
        "import json, os, sys\n"
        "index = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        "open(os.path.join(os.environ['OUT'], f'argv{index}'), 'w').write(json.dumps(sys.argv[1:]))\n"
    )
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(tmp_path))
    command = [sys.executable, "-m", "tf_adasum.run", "-np", "2", "-m", "flags_child", "--timeout", "3", "-x"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    for index in range(2):
        assert json.loads((tmp_path / f"argv{index}").read_text()) == ["--timeout", "3", "-x"]
    refused = subprocess.run(
        [sys.executable, "-m", "tf_adasum.run", "-np", "2", "-m"], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2 and "-m needs a module to run" in refused.stderr, refused.stderr


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["-np", "0"], "expected -np 1 or more, got 0"),
        (["-np", "-1"], "expected -np 1 or more, got -1"),
        (["-np", "2", "--timeout", "0"], "expected --timeout above 0, got 0.0"),
        (["-np", "0", "--elastic"], "expected -np 1 or more, got 0"),
        (["-np", "2", "--elastic", "--reset-limit", "-1"], "expected --reset-limit above -1, got -1"),
        (["-np", "2", "--elastic", "--standbys", "-2"], "expected --standbys above -1, got -2"),
        (["-np", "2", "--elastic", "--elastic-timeout", "0"], "expected --elastic-timeout above 0, got 0.0"),
        (["-np", "2", "-H", "localhost:1,-oProxyCommand=x:1"], "a host name is letters, digits"),
    ],
)
def test_sizes_and_hosts_no_job_can_keep_are_refused(flags: list[str], said: str, tmp_path: Path) -> None:
    """-np 0 and -np -1 exited 0 and said nothing."""
    (tmp_path / "child.py").write_text(CHILD)
    command = [
        sys.executable,
        "-m",
        "tf_adasum.run",
        *flags,
        str(tmp_path / "child.py"),
        str(tmp_path),
        "exit",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and said in done.stderr, done.stderr
    assert not list(tmp_path.glob("pid*")), "nothing started"


def test_an_output_folder_that_cannot_be_written_fails_before_any_rank_starts(tmp_path: Path) -> None:
    """It printed a traceback once rank 0 had started, and left rank 0 running."""
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "a_file").write_text("")
    command = [
        sys.executable,
        "-m",
        "tf_adasum.run",
        "-np",
        "2",
        "--output-filename",
        str(tmp_path / "a_file" / "out"),
    ]
    command += [str(tmp_path / "child.py"), str(tmp_path), "exit"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("tf_adasum.run: --output-filename ") and "is not a folder" in done.stderr
    assert "Traceback" not in done.stderr and not list(tmp_path.glob("pid*")), "nothing started"


def test_a_start_that_fails_ends_the_processes_already_started(tmp_path: Path) -> None:
    (tmp_path / "child.py").write_text(CHILD)
    command = [sys.executable, str(tmp_path / "child.py"), str(tmp_path), "hang"]
    with pytest.raises(
        StartError, match=r"could not start rank 1 on hostb through the agent '/no/such/agent'"
    ):
        static.launch(LaunchSettings(2, command, hosts="localhost:1,hostb:1", agent="/no/such/agent"))
    running = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True, check=False)
    assert running.stdout == "", "rank 0 was left running"


def test_a_process_killed_by_a_signal_exits_as_a_shell_says_it(tmp_path: Path) -> None:
    script = tmp_path / "killed.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert static.launch(LaunchSettings(1, [sys.executable, str(script)])) == 128 + 9
