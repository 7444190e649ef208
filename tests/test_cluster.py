"""Several hosts for real: each host a network namespace with its own address, hostname and shaped link
(scripts/cluster.py), the jobs started as across machines (mpirun through a launch agent in ssh's
place; `python -m tf_adasum.run -H host:slots`), both engines talking over the links.

Every launch is bounded (tests/support/processes.py); the clusters are made and removed by the tests. Without
root (CAP_NET_ADMIN) every test here skips, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support import processes
from tests.support.processes import log_tail

sys.path.insert(0, str(processes.ROOT / "scripts"))
import cluster

# Launches real processes: `make test` runs these, `make test-fast` (-m 'not multiprocess') does not.
# Its jobs cross shaped links and cut them on short timeouts: `make test` runs it after the rest, alone.
pytestmark = [pytest.mark.multiprocess, pytest.mark.alone]

WORKER = ["-m", "tests.workers.cluster"]
CUT_PEER_TIMEOUT = 10.0


def require_cluster() -> None:
    reason = cluster.available()
    if reason is not None:
        pytest.skip(f"no test cluster of network namespaces: {reason}")


@pytest.fixture(scope="module")
def two_hosts() -> Iterator[cluster.Cluster]:
    """Two hosts on 1 Gbit/s links, for every launch of this module but the cut ones."""
    require_cluster()
    with cluster.Cluster(hosts=2, name="tfat", rate="1gbit") as hosts:
        yield hosts


def test_the_cluster_gives_each_host_its_own_address_name_and_link(two_hosts: cluster.Cluster) -> None:
    for i, (address, name) in enumerate(zip(two_hosts.addresses, two_hosts.hostnames, strict=True)):
        seen = two_hosts.run(
            i, ["sh", "-c", "hostname; ip -o -4 addr show eth0"], capture_output=True, text=True
        )
        lines = seen.stdout.splitlines()
        assert lines[0] == name and f"inet {address}/24" in lines[1], seen
    # This machine's own hostname and network are untouched.
    assert os.uname().nodename not in two_hosts.hostnames
    ours = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    assert cluster.SUBNET not in ours
    # One host reaches the other by name, over its link: the counters move.
    before = two_hosts.bytes_sent()
    probe = "import socket; socket.create_connection(('tfath1', 9), timeout=5)"
    reached = two_hosts.run(0, [sys.executable, "-c", probe], capture_output=True, text=True)
    assert "ConnectionRefusedError" in reached.stderr, reached.stderr  # h1 answered: nothing listens there
    after = two_hosts.bytes_sent()
    assert after[0] > before[0] and after[1] > before[1], (before, after)


@pytest.mark.parametrize(("launcher", "per_host"), [("mpi", 1), ("tf", 1), ("mpi", 2), ("tf", 2)])
def test_fit_across_two_hosts_equals_the_simulation(
    two_hosts: cluster.Cluster, launcher: str, per_host: int, tmp_path: Path
) -> None:
    """AdasumStrategy with its default devices (the crash), a process alone on its host or one of two;
    with one each, also the plain Keras scripts under AdasumCallback and the Horovod example."""
    from tests.support.scripts import CALLBACK_MODES, HOROVOD_MODES, check_callback_run, check_horovod_run
    from tests.support.training import simulate

    p = 2 * per_host
    modes = f"strategy,{CALLBACK_MODES},{HOROVOD_MODES}" if per_host == 1 else "strategy"
    before = two_hosts.bytes_sent()
    code = processes.launch(launcher, p, tmp_path, [*WORKER, str(tmp_path), modes], cluster=two_hosts)
    assert code == 0, log_tail(tmp_path)
    sent = [b - a for a, b in zip(before, two_hosts.bytes_sent(), strict=True)]
    assert min(sent) > 2_000, sent  # the job's traffic went over both links (a fit of 8 weights: little)

    infos = [json.loads((tmp_path / f"strategy{r}.json").read_text()) for r in range(p)]
    for r, info in enumerate(infos):
        assert info["engine"] == launcher and info["replicas"] == p, info
        assert info["host"] == two_hosts.hostnames[r // per_host], info
        assert (info["local_rank"], info["local_size"]) == (r % per_host, per_host), info
        # Its own device only: under the TF engine TensorFlow also lists the other workers'.
        assert len(info["devices"]) == 1, info
        if launcher == "tf":
            assert f"/task:{r}/" in info["devices"][0], info
            assert info["address"].startswith(two_hosts.addresses[r // per_host] + ":"), info
    losses: list[float] = []
    want = simulate("adam", p, 2, 4, 8, losses)
    weights = [list(np.load(tmp_path / f"strategy{r}.npz").values()) for r in range(p)]
    for r in range(p):
        for got, first, w in zip(weights[r], weights[0], want, strict=True):
            np.testing.assert_array_equal(got, first)  # bitwise equal on every rank
            np.testing.assert_allclose(got, w, rtol=2e-5, atol=2e-5)
        assert infos[r]["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    if per_host == 1:
        check_callback_run(tmp_path, 2)
        check_horovod_run(tmp_path, 2)


def wait_for(condition: Callable[[], bool], seconds: float, what: str, out: Path) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not within {seconds:.0f} s:\n{log_tail(out)}")
        time.sleep(0.1)


@pytest.mark.parametrize("launcher", ["mpi", "tf"])
def test_a_cut_link_gives_every_rank_a_peer_error_naming_the_peer(launcher: str, tmp_path: Path) -> None:
    """A pulled cable mid-step: no connection closes, so only a timeout can tell (the MPI engine's own, or
    the TF engine's coordination service's heartbeats). Each side raises PeerError naming the rank beyond
    the cut within the timeout, and nothing hangs."""
    require_cluster()
    with cluster.Cluster(hosts=2, name="tfac", rate="1gbit") as hosts:
        extra = {"TF_ADASUM_TIMEOUT_SECONDS": str(int(CUT_PEER_TIMEOUT))}
        command, env = processes.launch_command(
            launcher, 2, [*WORKER, str(tmp_path), "cut"], extra, cluster=hosts
        )
        with (tmp_path / "output.log").open("w") as log:
            job = subprocess.Popen(
                command, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                ready = [tmp_path / f"ready{r}" for r in range(2)]
                wait_for(
                    lambda: all(f.exists() for f in ready), processes.LAUNCH_TIMEOUT, "both ranks", tmp_path
                )
                time.sleep(1.0)  # well inside the loop of all-reduces
                hosts.cut(1)
                cut_at = time.time()
                results = [tmp_path / f"cut{r}.json" for r in range(2)]
                wait_for(
                    lambda: all(f.exists() for f in results), CUT_PEER_TIMEOUT + 50, "both errors", tmp_path
                )
            finally:
                if job.poll() is None:
                    os.killpg(job.pid, signal.SIGKILL)
                job.wait(timeout=30)
    for r in range(2):
        result = json.loads(results[r].read_text())
        assert result["type"] == "PeerError", (r, result, log_tail(tmp_path))
        peer = (f"rank {1 - r} ", f"rank(s) [{1 - r}]")  # the MPI engine's words, the TF engine's
        assert result["message"].startswith(f"rank {r}:") and any(p in result["message"] for p in peer), (
            result
        )
        # It says which watcher noticed: the MPI engine's own timeout; under the TF engine, TensorFlow's
        # coordination service, on the rank that runs it and on the other.
        timeout = f"within {int(CUT_PEER_TIMEOUT)} s (TF_ADASUM_TIMEOUT_SECONDS)"
        watcher = timeout if launcher == "mpi" else "coordination service"
        assert watcher in result["message"], result
        # Within the timeout of the last call that went through (at most one call before the cut).
        assert result["at"] - cut_at < CUT_PEER_TIMEOUT + 20, (result["at"] - cut_at, result)


def namespaces_named(prefix: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return sorted(line.split()[0] for line in listed.splitlines() if line.startswith(prefix))


def test_an_interrupted_run_cleans_up_and_up_clears_what_a_killed_one_left(tmp_path: Path) -> None:
    require_cluster()
    # SIGTERM (a CI kill, pytest-timeout) mid-run: the context manager still takes the cluster down.
    holder = tmp_path / "holder.py"
    holder.write_text(
        f"import sys, time; sys.path.insert(0, {str(processes.ROOT / 'scripts')!r}); import cluster\n"
        "with cluster.Cluster(hosts=2, name='tfal'):\n"
        "    print('up', flush=True); time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, str(holder)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"
        assert namespaces_named("tfal-") == ["tfal-h0", "tfal-h1", "tfal-sw"]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert namespaces_named("tfal-") == []
    assert not (cluster.NETNS_ETC / "tfal-h0").exists() and not (cluster.STATE / "tfal.json").exists()

    # SIGKILL leaves everything; the next `up` of that name clears it, processes inside included.
    left = cluster.Cluster(hosts=2, name="tfal").up()
    sleeper = left.popen(1, ["sleep", "600"])
    with cluster.Cluster(hosts=3, name="tfal") as again:
        assert sleeper.wait(timeout=30) == -signal.SIGKILL
        assert namespaces_named("tfal-") == sorted([*again.namespaces, again.switch])
    assert namespaces_named("tfal-") == []


def test_without_root_the_cluster_says_why_and_the_tests_skip() -> None:
    """What every test above turns into where the process cannot make namespaces: a skip, with why."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or os.geteuid() != 0:
        pytest.skip("needs root and util-linux's setpriv to become another user")
    with tempfile.TemporaryDirectory() as folder:  # pytest's own tmp_path is root's alone
        test = Path(folder, "test_unprivileged.py")
        test.write_text(
            "import sys\n"
            f"sys.path.insert(0, {str(processes.ROOT)!r})\n"
            "from tests.test_cluster import require_cluster\n"
            "def test_it():\n    require_cluster()\n"
        )
        Path(folder).chmod(0o755)
        test.chmod(0o644)
        nobody = [setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups"]
        pytest_line = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            folder,
        ]
        done = subprocess.run(
            [*nobody, *pytest_line, str(test)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=folder,
            check=False,
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 skipped" in done.stdout and "making network namespaces needs root" in done.stdout, done.stdout


def test_an_elastic_job_grows_onto_a_host_and_goes_on_without_it(tmp_path: Path) -> None:
    """`tf_adasum.run --elastic` on host 0 of three: the discovery script lists two hosts, then rank 0
    adds the third (the job grows onto it at the next commit), then the third host's worker is killed
    (the job goes on with the first two). Remote workers start through the agent; each writes its
    commits on its own host. Every process comes from the launcher's pool of warm processes. A secret in
    the environment reaches every process and no process's command line. The second host's process of
    the last group finds its host's commits gone and resumes from the launcher's copy; and a new job
    resumes from the launcher's copies alone, the hosts' own files deleted, to the same weights."""
    require_cluster()
    from tests.support.elastic import WORKER as ELASTIC_WORKER
    from tests.support.elastic import assert_same_on_every_rank, read, weights

    marker = f"tf-adasum-test-secret-{os.getpid()}-{time.time_ns()}"
    seen: list[str] = []
    with cluster.Cluster(hosts=3, name="tfae", rate="1gbit") as hosts:
        a = hosts.addresses
        slots = tmp_path / "slots"
        slots.write_text(f"{a[0]}:1\n{a[1]}:1\n")
        discovery = tmp_path / "discover.sh"
        discovery.write_text(f"#!/bin/sh\ncat {slots}\n")
        discovery.chmod(0o755)
        env = dict(
            os.environ,
            PYTHONPATH=str(processes.ROOT),
            TF_CPP_MIN_LOG_LEVEL="3",
            TF_ADASUM_TIMEOUT_SECONDS="15",
            TF_ADASUM_CLUSTER=hosts.name,
            # Batches counted from each group's start: the growth waits for warm processes on the new
            # host (the group trains meanwhile), and the kill comes after the pool's refill began.
            FAULT="0:0:2:grow,1:2:40:kill,2:1:0:lostdisk",
            FAULT_BATCHES="relative",
            EPOCHS="16",
            FORWARDED_SECRET=marker,
            SLOTS_FILE=str(slots),
            GROW_TO=f"{a[0]}:1,{a[1]}:1,{a[2]}:1",
            SLOW_BATCH="0.4",
        )
        command = hosts.command(
            0,
            [
                sys.executable, "-m", "tf_adasum.run", "--elastic",
                "-np", "2", "--min-np", "2", "--max-np", "3",
                "--host-discovery-script", str(discovery), "--agent", processes.AGENT, "--timeout", "300",
                "--state-dir", str(tmp_path / "state"), *ELASTIC_WORKER, str(tmp_path), "strategy",
            ],
        )  # fmt: skip
        watching = threading.Event()
        watcher = threading.Thread(target=watch_command_lines, args=(marker, seen, watching), daemon=True)
        watcher.start()
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=330, check=False)
        watching.set()
        watcher.join(10)
        log = done.stdout + done.stderr
        (tmp_path / "output.log").write_text(log)
        assert done.returncode == 0, log[-6000:]

        # The hosts' own copies of the last commits are lost; the launcher's copies are enough.
        final = weights(tmp_path, 2)
        for own in (tmp_path / "state" / "group1").iterdir():
            own.unlink()
        again = tmp_path / "again"
        again.mkdir()
        command = hosts.command(
            0,
            [
                sys.executable, "-m", "tf_adasum.run", "--elastic", "-np", "2", "-H", f"{a[0]}:1,{a[1]}:1",
                "--agent", processes.AGENT, "--timeout", "150", "--state-dir", str(again / "state"),
                "--resume-from", str(tmp_path / "state" / "job" / "group1"), *ELASTIC_WORKER, str(again),
                "strategy",
            ],
        )  # fmt: skip
        env.pop("FAULT")
        resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180, check=False)
        (again / "output.log").write_text(resumed.stdout + resumed.stderr)
        assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-6000:]
    assert "group 1: 3 process(es)" in log and "group 2: 2 process(es)" in log, log[-6000:]
    assert f"rank 2 (w2@{a[2]}) lost: killed by SIGKILL" in log, log[-6000:]
    grown = read(tmp_path, "resumed-group1", 3)
    assert [r["host"] for r in grown] == hosts.hostnames, grown
    final_records = read(tmp_path, "final", 2)
    assert [(f["group"], f["size"], f["host"]) for f in final_records] == [
        (2, 2, h) for h in hosts.hostnames[:2]
    ]
    assert_same_on_every_rank(final)
    for group, size in ((0, 2), (1, 3), (2, 2)):
        records = read(tmp_path, f"resumed-group{group}", size)
        assert [(r["warm"], r["forwarded"]) for r in records] == [(True, True)] * size, records
    assert not seen, f"the secret was on a command line: {seen}"
    assert "resumed from the launcher's copy" in log, log[-6000:]
    # The new job: its ranks on the first two hosts, each from its launcher's copy, to the same weights.
    assert [r["host"] for r in read(again, "resumed-group0", 2)] == hosts.hostnames[:2]
    for a_weight, b_weight in zip(final[0], weights(again, 2)[0], strict=True):
        np.testing.assert_array_equal(a_weight, b_weight)


def watch_command_lines(marker: str, seen: list[str], done: threading.Event) -> None:
    """Reads every process's command line until `done`, noting any that holds `marker`."""
    while not done.wait(0.1):
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in text:
                seen.append(text)
