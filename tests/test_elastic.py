"""Elastic training: `python -m tf_adasum.run --elastic` with real processes that are killed, stopped,
fail during a commit, run out, grow and fail too often; and tf_adasum.elastic's state and callbacks.

The multi-process tests run tests/workers/elastic.py (the TF engine: the elastic launcher starts it), each
bounded by LAUNCH_TIMEOUT, with TF_ADASUM_TIMEOUT_SECONDS short so that a lost peer is noticed soon.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import tf_adasum
from tests.support.elastic import (
    LAUNCH_TIMEOUT,
    PEER_TIMEOUT,
    WORKER,
    assert_same_on_every_rank,
    commits_in,
    committed_optimizer,
    launch,
    read,
    tail,
    weights,
)
from tests.support.processes import ROOT
from tf_adasum import elastic
from tf_adasum.launch.elastic.driver import elastic_launch
from tf_adasum.launch.protocol import RESTART_EXIT_CODE
from tf_adasum.launch.settings import ElasticSettings

# Times detection and recovery: `make test` runs it after the rest, alone on the machine.
pytestmark = pytest.mark.alone


# Multi-process tests.


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "mode", ["strategy", "callback", "loop", "keras2_horovod", "strategy_outer", "callback_outer"]
)
def test_a_worker_killed_mid_step_leaves_the_job_to_the_survivors(mode: str, tmp_path: Path) -> None:
    """SIGKILL in rank 2's step: the survivors finish, equal on every rank, equal to a job that resumes
    from the same commits with the new membership, each with its own optimizer state. keras2_horovod is
    Horovod's elastic tf.keras script under tf_keras (Keras 2); strategy_outer and callback_outer have
    windows of 2 steps and an outer optimizer, whose state is committed and comes back the same on every
    process."""
    keras_2 = {"TF_USE_LEGACY_KERAS": "1"} if mode.startswith("keras2") else {}
    # The killed step is cut short, or ends before the kill: with an outer optimizer the group changes
    # after an odd number of steps of windows of 2, between two syncs.
    outer = mode.endswith("_outer")
    fault = "0:2:4:kill" if outer else "0:2:3:kill"
    code, log, _ = launch(tmp_path / "elastic", mode, 3, "--min-np", "2", env={"FAULT": fault, **keras_2})
    assert code == 0, tail(log)
    assert "rank 2 (w2@127.0.0.1) lost: killed by SIGKILL" in log, tail(log)
    assert "group 1: 2 process(es)" in log and "group 2" not in log, tail(log)
    # Every process of both groups came from the launcher's pool of warm processes.
    assert "group 1: 2 process(es) from the pool, 0 started cold" in log, tail(log)
    for group, size in ((0, 3), (1, 2)):
        assert [r["warm"] for r in read(tmp_path / "elastic", f"resumed-group{group}", size)] == [True] * size
    # The survivors knew within a second: each wrote its commits as it left, that soon after the kill
    # (in a GradientTape loop this took 6-32 s once, issue 42).
    killed = json.loads((tmp_path / "elastic" / "killed-group0-rank2.json").read_text())["time"]
    left = [f.stat().st_mtime - killed for f in (tmp_path / "elastic" / "state" / "group0").iterdir()]
    assert len(left) == 2 and max(left) < 1.0, left
    final = read(tmp_path / "elastic", "final", 2)
    assert [(f["group"], f["size"], f["epoch"], f["batch"]) for f in final] == [(1, 2, 2, 0)] * 2
    found = weights(tmp_path / "elastic", 2)
    assert_same_on_every_rank(found)

    # Each survivor resumed its own optimizer state from its own commit, and those differ (Adasum after
    # the optimizer: each process's Adam moments are its own).
    resumed = read(tmp_path / "elastic", "resumed-group1", 2)
    assert resumed[0]["commit"] == resumed[1]["commit"] >= 3
    group0 = tmp_path / "elastic" / "state" / "group0"
    files = sorted(group0.iterdir())
    assert [f.name for f in files] == ["rank0-w0.pkl", "rank1-w1.pkl"]
    own = [committed_optimizer(f, resumed[0]["commit"]) for f in files]
    assert own[0] != own[1]
    for r in range(2):
        np.testing.assert_allclose(resumed[r]["optimizer"], own[r], rtol=1e-6)
    if outer:  # the outer state: stepped before the loss, back the same everywhere
        assert resumed[0]["batch"] % 2 == 1, resumed[0]  # mid-window
        before = read(tmp_path / "elastic", "resumed-group0", 3)[0]["outer"]
        assert resumed[0]["outer"] == resumed[1]["outer"] != before, (before, resumed[0]["outer"])
        assert resumed[0]["outer"][0] >= 1  # the outer optimizer's iteration count: syncs before the loss
        assert (
            read(tmp_path / "elastic", "final", 2)[0]["outer"]
            == read(tmp_path / "elastic", "final", 2)[1]["outer"]
        )

    # The same commits, resumed by a new job of two: the same final weights, bit for bit.
    code, log, _ = launch(tmp_path / "again", mode, 2, "--resume-from", str(group0), env=keras_2)
    assert code == 0, tail(log)
    assert [r["commit"] for r in read(tmp_path / "again", "resumed-group0", 2)] == [resumed[0]["commit"]] * 2
    for a, b in zip(found[0], weights(tmp_path / "again", 2)[0], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.multiprocess
def test_a_hanging_worker_is_lost_after_the_timeout(tmp_path: Path) -> None:
    """SIGSTOP: the coordination service's heartbeats abort the others' collectives, they leave, and the
    launcher kills the stopped process as hung; the job finishes with two."""
    code, log, seconds = launch(
        tmp_path, "strategy", 3, "--min-np", "2", "--standbys", "1", env={"FAULT": "0:1:2:stop"}
    )
    assert code == 0, tail(log)
    assert "rank 1 (w1@127.0.0.1) lost: hung" in log, tail(log)
    # One warm process waits (--standbys 1): the second member of the next group starts cold, said so.
    assert "group 1: 1 process(es) from the pool, 1 started cold" in log, tail(log)
    assert re.search(r"no warm process on 127\.0\.0\.1 for w\d: it starts cold", log), tail(log)
    assert sorted(r["warm"] for r in read(tmp_path, "resumed-group1", 2)) == [False, True]
    # The survivors' own error names the hung rank and the watcher that noticed it: the collectives wait
    # without a timeout of their own, so it is the coordination service's heartbeats.
    assert re.search(
        r"PeerError: rank [02]: (lost rank 1 during a compiled step |.*with rank\(s\) \[1\] failed )"
        r"\(TensorFlow's coordination "
        r"service stopped hearing its heartbeats",
        log,
    ), tail(log)
    assert_same_on_every_rank(weights(tmp_path, 2))
    assert seconds < 2 * int(PEER_TIMEOUT) + 120


@pytest.mark.multiprocess
def test_a_failure_during_a_commit_resumes_from_the_commit_before(tmp_path: Path) -> None:
    """Rank 1 dies inside the commit after batch 4 (its copy made, the ranks not yet met): no survivor
    takes that commit as done, and the job resumes from the one after batch 3."""
    code, log, _ = launch(
        tmp_path, "callback", 3, "--min-np", "2", env={"FAULT": "0:1:4:commit", "RESET_LR": "0.01"}
    )
    assert code == 0, tail(log)
    resumed = read(tmp_path, "resumed-group1", 2)
    assert [(r["epoch"], r["batch"]) for r in resumed] == [(0, 4)] * 2, tail(log)
    # A reset callback's learning rate holds (Keras keeps it among the optimizer's variables, which the
    # resume loads): 0.01 x 2 processes, where the commit holds the first group's 0.05.
    assert [r["learning_rate"] for r in resumed] == [pytest.approx(0.02)] * 2
    assert_same_on_every_rank(weights(tmp_path, 2))


@pytest.mark.multiprocess
def test_a_peer_lost_before_the_training_function_keeps_the_commits(tmp_path: Path) -> None:
    """Group 1's rank 1 fails as it starts; rank 0 loses it in the script's own first collective, before
    `run`: it still passes its commits on, and group 2 resumes from them, not from the start."""
    code, log, _ = launch(
        tmp_path,
        "strategy",
        3,
        "--min-np",
        "1",
        "--standbys",
        "0",
        env={"FAULT": "0:1:3:kill,1:1:0:start", "PRELUDE": "1"},
    )
    assert code == 0, tail(log)
    # --standbys 0: no pool, every process starts cold.
    assert "from the pool" not in log and "starts cold" not in log, tail(log)
    assert "lost a peer before its training started" in log, tail(log)
    assert "group 2: 1 process(es): rank 0 w0@127.0.0.1 (resumes)" in log, tail(log)
    (group2,) = read(tmp_path, "resumed-group2", 1)
    assert group2["commit"] >= 3 and (group2["epoch"], group2["batch"]) != (0, 0), group2
    assert not group2["warm"]


@pytest.mark.multiprocess
def test_a_group_whose_every_process_fails_ends_the_job_at_once(tmp_path: Path) -> None:
    """A script that fails on every process (a bug) is not restarted, nor waited on for slots."""
    code, log, seconds = launch(
        tmp_path, "strategy", 2, "--min-np", "1", env={"FAULT": "0:0:0:start,0:1:0:start"}
    )
    assert code == 3, tail(log)
    assert "every process of group 0 failed" in log and "fails as it starts" in log, tail(log)
    assert "group 1" not in log and seconds < 90, tail(log)


@pytest.mark.multiprocess
def test_fewer_than_min_np_workers_end_the_job_naming_the_lost(tmp_path: Path) -> None:
    code, log, seconds = launch(
        tmp_path, "strategy", 2, "--min-np", "2", "--elastic-timeout", "3", env={"FAULT": "0:1:2:kill"}
    )
    assert code == 1, tail(log)
    assert "1 worker(s) available, fewer than --min-np 2, after waiting 3 s" in log, tail(log)
    assert "Lost workers: w1 on 127.0.0.1 (rank 1): lost: killed by SIGKILL" in log, tail(log)
    # The survivor's last commits stay on disk, whole.
    (kept,) = (tmp_path / "state" / "group0").iterdir()
    assert kept.stat().st_mode & 0o777 == 0o600
    commits = commits_in(kept)
    assert len(commits) == 2 and all("optimizer" in c for c in commits.values())
    assert seconds < int(PEER_TIMEOUT) + 90


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["strategy", "callback_outer"])
def test_a_discovered_slot_grows_the_job_at_the_next_commit(mode: str, tmp_path: Path) -> None:
    """A slot found by discovery grows the group at its next commit; the new process takes rank 0's
    state. With AdasumCallback's outer optimizer, given to the elastic state, that includes the outer
    state, stepped by then, the same as the survivors'."""
    slots = tmp_path / "slots"
    slots.write_text("127.0.0.1:2\n")
    runs = tmp_path / "discovery_runs"
    discovery = tmp_path / "discover.sh"
    discovery.write_text(f"#!/bin/sh\ndate +%s.%N >> {runs}\ncat {slots}\n")
    discovery.chmod(0o755)
    code, log, _ = launch(
        tmp_path,
        mode,
        2,
        "--max-np",
        "3",
        "--host-discovery-script",
        str(discovery),
        "--host-discovery-interval",
        "0.25",
        env={"FAULT": "0:0:2:grow", "SLOTS_FILE": str(slots), "SLOW_BATCH": "0.6", "EPOCHS": "8"},
    )  # long enough for the launcher to ready 3 warm processes (the group trains meanwhile)
    assert code == 0, tail(log)
    # The script ran every --host-discovery-interval seconds (1 s by default), give or take a busy machine.
    gaps = np.diff([float(t) for t in runs.read_text().split()])
    assert len(gaps) > 8 and 0.2 < float(np.median(gaps)) < 0.6, gaps
    assert "more slots reported; the group grows at its next commit" in log, tail(log)
    assert "group 1: 3 process(es)" in log, tail(log)
    # The new member, too, came from the pool.
    assert "group 1: 3 process(es) from the pool, 0 started cold" in log, tail(log)
    resumed = read(tmp_path, "resumed-group1", 3)
    assert [r["warm"] for r in resumed] == [True] * 3
    assert len({(r["epoch"], r["batch"], r["commit"]) for r in resumed}) == 1
    assert resumed[0]["batch"] > 2 or resumed[0]["epoch"] > 0
    # The new process took rank 0's optimizer state; the survivors kept their own.
    assert resumed[2]["optimizer"] == resumed[0]["optimizer"] != resumed[1]["optimizer"]
    if mode == "callback_outer":  # and the one outer state, stepped (its iteration count first)
        assert resumed[2]["outer"] == resumed[0]["outer"] == resumed[1]["outer"], resumed
        assert resumed[0]["outer"][0] >= 1, resumed[0]["outer"]
    final = read(tmp_path, "final", 3)
    assert {(f["group"], f["size"], f["epoch"]) for f in final} == {(1, 3, 8)}
    assert_same_on_every_rank(weights(tmp_path, 3))


def churn_trace(changes: int) -> tuple[list[str], list[str], list[int]]:
    """For `changes` membership changes of a job of 3 (--min-np 2): the change of each group, a loss in
    every even group, by turns a host that leaves the list, a death inside a commit and a death at the
    group's very first batch (a change right after the last); a return in every odd group, the host
    listed again. Every loss delists its host (rank 0 writes the smaller list as the group starts, where
    the dying process does not), so the list alternates between 3 and 2 slots and each answer differs
    from the last, which frees the lost slot. Returns the changes, every FAULT entry, and the groups'
    sizes."""
    changes_made, entries, sizes = [], [], [3]
    for group in range(changes):
        if group % 2 == 0:
            change = [f"{group}:2:2:leave2", f"{group}:1:2:commit", f"{group}:2:0:killfirst"][group // 2 % 3]
            if not change.endswith("leave2"):
                entries.append(f"{group}:0:0:slots2")
            sizes.append(2)
        else:
            change = f"{group}:0:1:slots3"
            sizes.append(3)
        changes_made.append(change)
        entries.append(change)
    return changes_made, entries, sizes


@pytest.mark.multiprocess
def test_a_job_survives_a_churn_of_losses_and_returns_losing_only_the_steps_since_each_commit(
    tmp_path: Path,
) -> None:
    """A trace of changes (TF_ADASUM_TEST_CHURN of them, 6 here; run it with 20 by hand): each group resumes
    from its predecessors' newest common commit, so nothing but the steps since it is lost, and the last
    group's weights equal a new job's that resumes from the same commits with the same membership."""
    changes = int(os.environ.get("TF_ADASUM_TEST_CHURN", "6"))
    faults, entries, sizes = churn_trace(changes)
    slots = tmp_path / "slots"
    slots.write_text("127.0.0.1:3\n")
    discovery = tmp_path / "discover.sh"
    discovery.write_text(f"#!/bin/sh\ncat {slots}\n")
    discovery.chmod(0o755)
    env = {
        "FAULT": ",".join(entries),
        "SLOTS_FILE": str(slots),
        "SLOW_BATCH": "0.5",
        "FAULT_BATCHES": "relative",
        # Each return waits for warm processes for the whole group (~25 s here), while the group trains.
        "EPOCHS": str(4 + 6 * (changes // 2)),
    }
    code, log, _ = launch(
        tmp_path / "churn", "strategy", 3, "--min-np", "2", "--max-np", "3",
        "--host-discovery-script", str(discovery), env=env,
        timeout=LAUNCH_TIMEOUT + 40 * max(0, changes - 6),  # a return waits ~25 s for warm processes
    )  # fmt: skip
    assert code == 0, tail(log)
    formed = [int(n) for n in re.findall(r"group \d+: (\d+) process\(es\): ", log)]
    assert formed == sizes, (formed, tail(log))
    for group in range(1, len(sizes)):
        resumed = read(tmp_path / "churn", f"resumed-group{group}", sizes[group])
        assert len({(r["epoch"], r["batch"], r["commit"]) for r in resumed}) == 1, resumed
        # The launcher's copies of the commits the last group's survivors left with: the group resumed
        # from the newest that every survivor held.
        copies = sorted((tmp_path / "churn" / "state" / "job" / f"group{group - 1}").glob("*.pkl"))
        newest = []
        for copy in copies:
            newest.append(max(commits_in(copy)))
        assert resumed[0]["commit"] == min(newest), (group, resumed[0], newest)
        # A loss costs the steps since the last commit alone: killed inside the commit after its group's
        # batch b (b counted from the group's start; the commit never completed), a process leaves the
        # next group to resume b batches after this one did.
        _, _, b, kind = faults[group - 1].split(":")
        before = read(tmp_path / "churn", f"resumed-group{group - 1}", sizes[group - 1])[0]
        step, step_before = (
            8 * resumed[0]["epoch"] + resumed[0]["batch"],
            8 * before["epoch"] + before["batch"],
        )
        if kind == "commit":
            assert step == step_before + int(b), (group, before, resumed[0])
        elif kind.startswith("leave"):  # killed 50 ms into batch b: in its step, or after its commit
            assert step in (step_before + int(b), step_before + int(b) + 1), (group, before, resumed[0])
        elif kind == "killfirst":
            assert step == step_before, (group, before, resumed[0])
        else:  # a return: the group grows at a commit after the host is listed again
            assert step > step_before, (group, before, resumed[0])
    final = weights(tmp_path / "churn", sizes[-1])
    assert_same_on_every_rank(final)

    last = tmp_path / "churn" / "state" / "job" / f"group{len(sizes) - 2}"
    code, log, _ = launch(
        tmp_path / "replay", "strategy", sizes[-1], "--resume-from", str(last), env={"EPOCHS": env["EPOCHS"]}
    )
    assert code == 0, tail(log)
    for a, b in zip(final[0], weights(tmp_path / "replay", sizes[-1])[0], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.multiprocess
def test_too_many_resets_end_the_job_with_the_last_workers_error(tmp_path: Path) -> None:
    code, log, _ = launch(
        tmp_path, "strategy", 3, "--min-np", "1", "--reset-limit", "1", env={"FAULT": "0:2:2:exit,1:1:2:exit"}
    )
    assert code == 3, tail(log)
    assert (
        "more than --reset-limit 1 resets; the last lost worker was w1 on 127.0.0.1: lost: exited with 3"
        in log
    )
    assert "worker error: rank 1 of group 1 fails at batch 2" in log


@pytest.mark.multiprocess
def test_horovods_elastic_state_test_on_two_processes(tmp_path: Path) -> None:
    """Horovod's test_elastic_state with the import changed, under the plain launcher (one group)."""
    done = subprocess.run(
        [sys.executable, "-m", "tf_adasum.run", "-np", "2", "--timeout", "120",
         *WORKER, str(tmp_path), "horovod_state"],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3"),
        capture_output=True, text=True, timeout=150, check=False,
    )  # fmt: skip
    assert done.returncode == 0, tail(done.stdout + done.stderr)
    for result in read(tmp_path, "horovod_state", 2):
        assert result == {
            "synced": True,
            "synced_objects": [20, 10],
            "restored": True,
            "restored_objects": [20, 10],
            "committed": True,
            "committed_objects": [21, 11],
        }


@pytest.mark.multiprocess
def test_horovods_elastic_tf_keras_script_runs_under_horovodrun_as_one_group(tmp_path: Path) -> None:
    """Horovod's elastic tf.keras script (tf_keras, DistributedOptimizer(op=Adasum), KerasState and the
    elastic callbacks) under horovodrun's Gloo mode, without an elastic driver: one group that does not
    change, which trains as the same script does under `tf_adasum.run --elastic` with no fault."""
    from tests.support.processes import launch as launch_plain
    from tests.support.processes import log_tail

    keras_2 = {"TF_USE_LEGACY_KERAS": "1"}
    code = launch_plain(
        "horovodrun", 2, tmp_path, [*WORKER, str(tmp_path), "keras2_horovod"], extra_env=keras_2
    )
    assert code == 0, log_tail(tmp_path)
    final = read(tmp_path, "final", 2)
    assert [(f["size"], f["epoch"], f["batch"]) for f in final] == [(2, 2, 0)] * 2
    found = weights(tmp_path, 2)
    assert_same_on_every_rank(found)
    code, log, _ = launch(tmp_path / "elastic", "keras2_horovod", 2, env=keras_2)
    assert code == 0, tail(log)
    for a, b in zip(found[0], weights(tmp_path / "elastic", 2)[0], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_elastic_benchmark_smoke_run_goes_end_to_end(tmp_path: Path) -> None:
    """benchmarks/studies/elastic.py --smoke: a 3 -> 2 -> 3 job and the commit cost, its tables and plot."""
    command = [
        sys.executable, str(ROOT / "benchmarks" / "studies" / "elastic.py"), "--smoke",
        "--out", str(tmp_path / "out"), "--data", str(tmp_path / "digits.npz"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out_smoke"
    for name in ("summary.csv", "recovery.csv", "commit_cost.csv", "accuracy_vs_step.png"):
        assert (out / name).stat().st_size > 0, name
    changes = (out / "recovery.csv").read_text()
    assert "3 -> 2" in changes and "2 -> 3" in changes, changes


# In one process.


def test_elastic_flags_need_elastic() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tf_adasum.run", "-np", "2", "--min-np", "1", "x.py"],
        capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2 and "--min-np only go with --elastic" in done.stderr


def test_the_launcher_refuses_sizes_it_cannot_keep() -> None:
    """Nothing is quietly changed: --max-np below -np, --min-np above it, or -H with too few slots."""
    with pytest.raises(ValueError, match=r"expected 1 <= --min-np <= -np <= --max-np, got 2, 3, 2"):
        ElasticSettings(3, ["true"], min_np=2, max_np=2)
    with pytest.raises(ValueError, match=r"got 4, 3, 3"):
        ElasticSettings(3, ["true"], min_np=4)
    with pytest.raises(ValueError, match=r"-H 'a:1,b:1' has 2 slots for -np 3"):
        elastic_launch(ElasticSettings(3, ["true"], hosts="a:1,b:1"))
    with pytest.raises(ValueError, match=r"expected --host-discovery-interval above 0, got -1"):
        ElasticSettings(3, ["true"], discovery_script="true", discovery_interval=-1)


def test_restart_exit_code_is_not_a_common_one() -> None:
    assert RESTART_EXIT_CODE not in (0, 1, 2, 124, 130, 137)


def _model() -> keras.Model:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.set_weights([np.full((3, 2), 0.1, np.float32), np.zeros(2, np.float32)])
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    return model


class _RunsCode:
    """A pickle that runs code when loaded: what another user put in place of a commit."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.mkdir, (str(self.marker),))


def test_a_commit_file_that_was_replaced_is_refused_never_unpickled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A survivor unpickled its state file as it found it: another user who could write it ran code as
    the job's owner. Now the file is private, sealed under the job's key and checked first."""
    from tf_adasum.elastic import state as elastic_state
    from tf_adasum.launch.secret import ENV_SECRET, AuthenticationError, new_secret, seal

    key, path = new_secret(), tmp_path / "state" / "group0" / "rank0-w0.pkl"
    elastic_state.write_commits(str(path), {3: {"objects": {"epoch": 1}}}, key)
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    monkeypatch.setenv(elastic_state.ENV_RESUME_FILE, str(path))
    monkeypatch.setenv(ENV_SECRET, key)
    assert elastic_state._load_resume_file() == {3: {"objects": {"epoch": 1}}}
    marker = tmp_path / "ran"
    for replaced, said in (
        (pickle.dumps(_RunsCode(marker)), "does not start as a file sealed by tf_adasum"),
        (seal(new_secret(), pickle.dumps(_RunsCode(marker))), "was not written under this job's key"),
    ):
        path.write_bytes(replaced)
        with pytest.raises(AuthenticationError, match=said):
            elastic_state._load_resume_file()
        assert not marker.exists()


def test_state_commit_restore_and_the_optimizer_in_one_process() -> None:
    model = _model()
    state = elastic.KerasState(model, epoch=0, batch=0)  # builds the optimizer
    assert model.optimizer.built
    x = np.ones((4, 3), np.float32)
    model.fit(x, np.zeros((4, 2), np.float32), verbose=0)
    state.batch = 1
    state.commit()
    at_commit = [v.numpy().copy() for v in model.optimizer.variables]
    weights_at_commit = model.get_weights()
    model.fit(x, np.zeros((4, 2), np.float32), verbose=0)
    state.batch = 2
    state.restore()
    assert state.batch == 1
    for v, saved in zip(model.optimizer.variables, at_commit, strict=True):
        np.testing.assert_array_equal(v.numpy(), saved)
    for a, b in zip(model.get_weights(), weights_at_commit, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("legacy", [False, True], ids=["optimizer", "legacy-optimizer"])
def test_state_commit_and_restore_of_a_tf_keras_model_and_optimizer(legacy: bool) -> None:
    """KerasState serves a tf_keras (Keras 2) model: its weights and its optimizer's state (tf_keras's
    optimizer, or its legacy OptimizerV2, whose variables are a method) are committed and restored, and
    the elastic callbacks run in tf_keras's fit."""
    import tf_keras

    from tf_adasum import _compat

    model = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(2)])
    model.compile((tf_keras.optimizers.legacy.Adam if legacy else tf_keras.optimizers.Adam)(0.1), "mse")
    state = elastic.KerasState(model, epoch=0, batch=0)  # builds the optimizer
    assert len(_compat.optimizer_variables(model.optimizer)) == 5
    x, y = np.ones((8, 3), np.float32), np.zeros((8, 2), np.float32)
    callbacks = [
        elastic.UpdateEpochStateCallback(state),
        elastic.UpdateBatchStateCallback(state),
        elastic.CommitStateCallback(state, batches_per_commit=2),
    ]
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=callbacks)
    assert (state.epoch, state.batch) == (1, 0)
    at_commit = [v.numpy().copy() for v in _compat.optimizer_variables(model.optimizer)]
    weights_at_commit = model.get_weights()
    assert int(model.optimizer.iterations) == 4
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    state.restore()
    assert int(model.optimizer.iterations) == 4
    for v, saved in zip(_compat.optimizer_variables(model.optimizer), at_commit, strict=True):
        np.testing.assert_array_equal(v.numpy(), saved)
    for a, b in zip(model.get_weights(), weights_at_commit, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_resumed_tf_keras_fit_skips_the_batches_done() -> None:
    """UpdateBatchStateCallback's resume inside tf_keras's fit: the batches done are read and dropped."""
    import tf_keras

    model = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(2)])
    model.compile(tf_keras.optimizers.SGD(0.1), "mse")
    state = elastic.KerasState(model, epoch=0, batch=3)
    seen: list[int] = []
    record = tf_keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(batch))
    model.fit(
        np.ones((10, 3), np.float32), np.zeros((10, 2), np.float32), batch_size=2, epochs=1, verbose=0,
        callbacks=[elastic.UpdateBatchStateCallback(state), record],
    )  # fmt: skip
    assert int(model.optimizer.iterations) == 2, "5 batches, 3 of them done before the resume"
    assert state.batch == 0 and seen == [0, 1, 2, 3, 4]


def test_an_elastic_sync_spares_adasums_broadcast_before_the_first_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a KerasState's sync every process holds root's weights; AdasumOptimizer's broadcast before
    its first step would send the whole model again at every group's start. A fit with no sync before it
    still broadcasts, once."""
    broadcasts: list[int] = []
    real = tf_adasum.training.optimizer.broadcast_variables
    monkeypatch.setattr(
        tf_adasum.training.optimizer,
        "broadcast_variables",
        lambda variables, root: (broadcasts.append(len(variables)), real(variables, root)),
    )
    x, y = np.ones((8, 3), np.float32), np.zeros((8, 2), np.float32)
    for synced in (False, True):
        broadcasts.clear()
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
        model.compile(optimizer=optimizer, loss="mse")
        state = elastic.KerasState(model, epoch=0, batch=0)
        if synced:
            state.sync()
        model.fit(x, y, batch_size=4, epochs=2, verbose=0)
        assert broadcasts == ([] if synced else [2]), (synced, broadcasts)


def test_the_run_wrapper_outside_the_launcher_raises_a_lost_peer() -> None:
    state = elastic.ObjectState(epoch=0)

    @elastic.run
    def train(state: elastic.State) -> None:
        raise tf_adasum.PeerError("rank 0: lost rank 1")

    with pytest.raises(tf_adasum.PeerError, match="lost rank 1"):
        train(state)


def test_a_resumed_fit_skips_the_batches_done() -> None:
    """state.batch = 3: the fit trains on batches 3.. of the epoch only, as a fit of those rows does; the
    dropped batches neither move state.batch back nor commit (a commit there held the weights of batch 3
    under the count of batch 1: a loss then resumed at the wrong batch, which the churn test found)."""
    x = np.random.default_rng(0).standard_normal((32, 3)).astype(np.float32)
    y = np.random.default_rng(1).standard_normal((32, 2)).astype(np.float32)
    resumed = _model()
    state = elastic.KerasState(resumed, epoch=0, batch=3)
    seen, counts, committed = [], [], []
    state.commit = lambda: committed.append((int(state.epoch), int(state.batch)))  # type: ignore[method-assign]

    class Batches(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            seen.append(batch)
            counts.append(int(state.batch))

    resumed.fit(
        x, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
        callbacks=[
            elastic.UpdateEpochStateCallback(state), elastic.UpdateBatchStateCallback(state),
            elastic.CommitStateCallback(state, batches_per_commit=1), Batches(),
        ],
    )  # fmt: skip
    assert (state.epoch, state.batch) == (2, 0)
    assert seen == list(range(8)) * 2  # Keras's numbering stays the epoch's
    assert counts == [3, 3, 3, 4, 5, 6, 7, 8, *range(1, 9)]
    # A commit after every batch trained (5 then 8) and at each epoch's end, none for a dropped batch.
    assert committed == [(0, b) for b in range(4, 9)] + [(1, 0)] + [(1, b) for b in range(1, 9)] + [(2, 0)]
    reference = _model()
    elastic.KerasState(reference)
    reference.fit(x[12:], y[12:], batch_size=4, epochs=1, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(resumed.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_the_epoch_callback_counts_from_initial_epoch_or_from_zero() -> None:
    x, y = np.zeros((4, 3), np.float32), np.zeros((4, 2), np.float32)
    for initial in (True, False):
        model = _model()
        state = elastic.KerasState(model, epoch=3, batch=0)
        callback = elastic.UpdateEpochStateCallback(state)
        if initial:  # fit(initial_epoch=state.epoch, epochs=5)
            model.fit(x, y, epochs=5, initial_epoch=state.epoch, verbose=0, callbacks=[callback])
        else:  # Horovod's fit(epochs=5 - state.epoch)
            model.fit(x, y, epochs=5 - state.epoch, verbose=0, callbacks=[callback])
        assert state.epoch == 5


def test_commit_callback_commits_every_k_batches_and_at_epoch_end() -> None:
    model = _model()
    state = elastic.KerasState(model, epoch=0, batch=0)
    commits = []
    original = state.commit
    state.commit = lambda: (commits.append("c"), original())  # type: ignore[method-assign]
    x, y = np.zeros((28, 3), np.float32), np.zeros((28, 2), np.float32)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[elastic.CommitStateCallback(state, 3)])
    assert commits.count("c") == 7 // 3 + 1
    with pytest.raises(ValueError, match="batches_per_commit must be at least 1, got 0"):
        elastic.CommitStateCallback(state, 0)


def test_horovods_names_are_tf_adasums() -> None:
    import tf_adasum.keras as hvd_keras
    import tf_adasum.tensorflow as hvd_tf

    for hvd in (hvd_keras, hvd_tf):
        for name in (
            "run", "State", "ObjectState", "TensorFlowKerasState", "TensorFlowState", "KerasState",
            "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
        ):  # fmt: skip
            assert getattr(hvd.elastic, name) is getattr(elastic, name)
