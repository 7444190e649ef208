"""`python -m tf_adasum.run --elastic`: a job that goes on when workers are lost or slots are added.

The launcher runs the job as a series of groups. A group is a TF_CONFIG cluster of processes with ranks
0..n-1; it ends when every process has exited. A process exits with
- 0: its training function returned (the job is done when every process of the group says so);
- elastic_protocol.RESTART_EXIT_CODE: it survived a lost peer, or the launcher reported new slots;
  its last commits are in its state file (see tf_adasum/elastic.py);
- anything else, or a signal: it is lost. So is a process that has not exited PEER_TIMEOUT + GRACE
  seconds after another of its group did (it hangs: SIGSTOP, a dead host).
The next group takes the survivors first, in their old rank order, each pointed at its state file,
then new processes for free slots, up to --max-np (tf_adasum/elastic_policy.py holds these rules). A
lost process's slot stays empty until the host discovery script's answer changes (without a script:
for the rest of the job). Fewer than --min-np workers for --elastic-timeout seconds, or more than
--reset-limit resets, end the job with an error naming the lost workers.

The slots come from --host-discovery-script (horovodrun's: it prints `host:slots` lines; it is run
every DISCOVERY_SECONDS) or from -H. When the script reports more slots than the group uses, and the
group is smaller than --max-np, the launcher posts a notice; rank 0 reads it, and every rank leaves at
the next commit, so the next group is larger.

No TensorFlow here: the launcher starts in a fraction of a second.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tf_adasum import elastic_policy as policy
from tf_adasum.elastic_policy import parse_slots
from tf_adasum.elastic_protocol import NoticeBoard, peer_timeout_seconds, process_environment
from tf_adasum.hosts import DEFAULT_AGENT, GRACE_SECONDS, LOCAL_HOSTS, free_ports, remote_command
from tf_adasum.launch_output import Output

DISCOVERY_SECONDS = 1.0


class ElasticError(RuntimeError):
    """The job cannot go on: too few workers, too many resets."""


class Discovery:
    """The slots the job may use: the discovery script's latest answer, or -H's."""

    def __init__(self, script: str | None, hosts: str | None, np: int) -> None:
        self.script = script
        self.static = parse_slots(hosts.replace(",", "\n")) if hosts else {"127.0.0.1": np}
        self.problem: str | None = None

    def slots(self) -> dict[str, int]:
        if not self.script:
            return dict(self.static)
        try:
            done = subprocess.run(
                self.script, shell=True, capture_output=True, text=True, timeout=30, check=False
            )
            if done.returncode != 0:
                raise ValueError(f"exited with {done.returncode}: {done.stderr.strip()[-300:]}")
            self.problem = None
            return parse_slots(done.stdout)
        except (ValueError, subprocess.TimeoutExpired) as error:
            if self.problem != str(error):
                sys.stderr.write(f"tf_adasum.run: host discovery script {self.script!r}: {error}\n")
            self.problem = str(error)
            return {}


@dataclass
class Worker:
    id: str
    host: str
    resume_file: str = ""
    state_file: str = ""
    rank: int = -1
    proc: Any = None
    outcome: str | None = None  # "done", "restart", or why it was lost
    code: int | None = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=30))


def _say(message: str) -> None:
    sys.stderr.write(f"tf_adasum.run: {message}\n")
    sys.stderr.flush()


def elastic_launch(
    np: int,
    command: list[str],
    min_np: int | None = None,
    max_np: int | None = None,
    hosts: str | None = None,
    discovery_script: str | None = None,
    reset_limit: int | None = None,
    elastic_timeout: float = 600.0,
    timeout: float | None = None,
    agent: str = DEFAULT_AGENT,
    state_dir: str | None = None,
    resume_from: str | None = None,
    output_filename: str | None = None,
) -> int:
    """Runs `command` elastically; returns 0 when a group finishes, else the failure's exit code.

    Args:
        np: the first group's size.
        command: what each process runs.
        min_np: the fewest workers the job goes on with (default np).
        max_np: the most workers (default np).
        hosts: -H host:slots,... (without a discovery script); default np slots on 127.0.0.1.
        discovery_script: prints the available host:slots lines; run every second.
        reset_limit: how many resets (new groups after the first) the job may take; None: any number.
        elastic_timeout: how long to wait for min_np slots before giving up.
        timeout: seconds after which everything is killed (exit code 124).
        agent: how a process starts on another host.
        state_dir: where processes write their commits when they leave a group (on their own host).
        resume_from: a group directory of an earlier job's state_dir: the first group resumes from its
            commits (rank i from the i-th file by old rank), as if it were the next group.
        output_filename: a folder for each process's stdout and stderr, per group:
            DIR/group<g>/rank.<r>/stdout and stderr.
    """
    min_np = np if min_np is None else min_np
    max_np = np if max_np is None else max_np
    if not 1 <= min_np <= np <= max_np:
        raise ValueError(f"expected 1 <= --min-np <= -np <= --max-np, got {min_np}, {np}, {max_np}")
    state_dir = state_dir or os.path.join("/tmp", "tf_adasum_elastic", f"{os.getpid()}-{int(time.time())}")
    os.makedirs(state_dir, exist_ok=True)
    discovery = Discovery(discovery_script, hosts, np)
    if not discovery_script and sum(discovery.static.values()) < np:
        raise ValueError(f"-H {hosts!r} has {sum(discovery.static.values())} slots for -np {np}")
    all_local = not discovery_script and all(h in LOCAL_HOSTS for h in discovery.static)
    notices = NoticeBoard()
    threading.Thread(target=notices.serve_forever, daemon=True).start()
    advertised = "127.0.0.1" if all_local else _own_address()
    deadline = None if timeout is None else time.monotonic() + timeout

    survivors: list[Worker] = []
    if resume_from:
        files = sorted(
            (f for f in os.listdir(resume_from) if f.endswith(".pkl")), key=lambda f: int(f.split("-")[0][4:])
        )
        survivors = [
            Worker(id=f.split("-", 1)[1][:-4], host="127.0.0.1", resume_file=os.path.join(resume_from, f))
            for f in files
        ]
    lost: list[Worker] = []
    blocked: collections.Counter[str] = collections.Counter()
    last_answer: dict[str, int] | None = None
    next_id = 0
    group = 0
    resets = 0

    def fresh_answer() -> dict[str, int]:
        """The discovery's answer; a changed answer frees the slots of lost workers."""
        nonlocal last_answer
        answer = discovery.slots()
        if discovery_script and last_answer is not None and answer != last_answer:
            blocked.clear()
        last_answer = answer
        return answer

    def more_slots(in_use: int) -> bool:
        return bool(discovery_script) and policy.has_more_slots(fresh_answer(), blocked, in_use, max_np)

    try:
        while True:
            # The group's members: the survivors that still have a slot, then new processes.
            wait_until = time.monotonic() + elastic_timeout
            while True:
                chosen = policy.choose_members(
                    fresh_answer(), blocked, [w.host for w in survivors], np if group == 0 else max_np
                )
                if chosen.size >= min_np:
                    members = [survivors[i] for i in chosen.kept]
                    members += [Worker(id=f"w{next_id + i}", host=h) for i, h in enumerate(chosen.new_hosts)]
                    next_id += len(chosen.new_hosts)
                    break
                if deadline is not None and time.monotonic() > deadline:
                    _say("the --timeout passed while waiting for slots")
                    return 124
                if time.monotonic() > wait_until:
                    gone = (
                        "; ".join(f"{w.id} on {w.host} (rank {w.rank}): {w.outcome}" for w in lost) or "none"
                    )
                    raise ElasticError(
                        f"{chosen.size} worker(s) available, fewer than --min-np {min_np}, "
                        f"after waiting {elastic_timeout:.0f} s for slots. Lost workers: {gone}. "
                        f"The last commits are in {_last_group_dir(state_dir, group)} "
                        "(resume with --resume-from)"
                    )
                time.sleep(DISCOVERY_SECONDS)
            survivors = []
            driver = f"{advertised}:{notices.server_address[1]}"
            code = _run_group(
                group,
                members,
                command,
                notices,
                driver,
                more_slots,
                state_dir,
                agent,
                output_filename,
                deadline,
            )
            if code is not None:
                return code
            ended = [w for w in members if w.outcome not in (policy.RESTART, policy.DONE)]
            for w in ended:
                blocked[w.host] += 1
                lost.append(w)
            survivors = [w for w in members if w.outcome == policy.RESTART]
            end = policy.group_end([str(w.outcome) for w in members])
            if end is policy.GroupEnd.DONE:
                return 0
            if end is policy.GroupEnd.ALL_FAILED:
                # A bug in the script, a bad argument: no one is left to resume.
                first = ended[0]
                _say(
                    f"every process of group {group} failed; rank {first.rank} ({first.id}@{first.host}) "
                    f"{first.outcome}; its last output: {_last_error(first)}"
                )
                return first.code if first.code and first.code > 0 else 1
            if end is policy.GroupEnd.FINISHED:
                finished = [w.rank for w in members if w.outcome == policy.DONE]
                _say(
                    f"group {group}: rank(s) {finished} finished training while others left it; the job is "
                    "done"
                )
                return 0
            for w in survivors:
                w.resume_file = w.state_file
            _say(
                f"group {group} ended: "
                + ", ".join(f"rank {w.rank} ({w.id}@{w.host}) {w.outcome}" for w in members)
            )
            resets += 1
            if reset_limit is not None and resets > reset_limit:
                last = ended[-1] if ended else (lost[-1] if lost else None)
                why = (
                    f"{last.id} on {last.host}: {last.outcome}; its last output: {_last_error(last)}"
                    if last
                    else ""
                )
                _say(f"more than --reset-limit {reset_limit} resets; the last lost worker was {why}")
                return last.code if last and last.code and last.code > 0 else 1
            group += 1
    except ElasticError as error:
        _say(str(error))
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        notices.shutdown()


def _last_group_dir(state_dir: str, group: int) -> str:
    return os.path.join(state_dir, f"group{max(group - 1, 0)}")


def _last_error(worker: Worker) -> str:
    lines = [line for line in worker.tail if line.strip()]
    return lines[-1] if lines else "(no output)"


def _own_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _run_group(
    group: int,
    members: list[Worker],
    command: list[str],
    notices: NoticeBoard,
    driver: str,
    more_slots: Any,
    state_dir: str,
    agent: str,
    output_filename: str | None,
    deadline: float | None,
) -> int | None:
    """Runs one group to its end; sets each worker's outcome. Returns an exit code that ends the job
    (the timeout, Ctrl-C), or None."""
    ports = free_ports(len(members))
    workers = [f"{w.host}:{port}" for w, port in zip(members, ports, strict=True)]
    group_dir = os.path.join(state_dir, f"group{group}")
    _say(
        f"group {group}: {len(members)} process(es): "
        + ", ".join(
            f"rank {r} {w.id}@{w.host}{' (resumes)' if w.resume_file else ''}" for r, w in enumerate(members)
        )
    )
    output = Output(os.path.join(output_filename, f"group{group}") if output_filename else None)
    for rank, w in enumerate(members):
        w.rank, w.outcome, w.code, w.proc = rank, None, None, None
        w.state_file = os.path.join(group_dir, f"rank{rank}-{w.id}.pkl")
        env = dict(os.environ, TF_ADASUM_LAUNCHER="1")
        env["TF_CONFIG"] = json.dumps(
            {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}
        )
        env.update(process_environment(group, w.state_file, w.resume_file, driver))
        line = command if w.host in LOCAL_HOSTS else remote_command(agent, w.host, command, env)
        w.proc = subprocess.Popen(
            line, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        output.follow(rank, w.proc.stdout, w.proc.stderr, w.tail)

    def kill(w: Worker) -> None:
        if w.proc.poll() is None:
            try:
                os.killpg(w.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    first_exit: float | None = None
    last_alone: float | None = None
    next_discovery = time.monotonic() + DISCOVERY_SECONDS
    try:
        while True:
            now = time.monotonic()
            for w in members:
                if w.outcome is None and w.proc.poll() is not None:
                    w.code = w.proc.returncode
                    w.outcome = policy.process_outcome(w.code)
                    if w.code != 0 and first_exit is None:
                        first_exit = now
            if all(w.outcome is not None for w in members):
                return None
            running = [w for w in members if w.outcome is None]
            if first_exit is not None and len(running) == 1 and last_alone is None:
                last_alone = now
            if policy.hung(now, first_exit, last_alone, peer_timeout_seconds(), GRACE_SECONDS):
                for w in running:
                    kill(w)
                    w.proc.wait()
                    w.code = w.proc.returncode
                    w.outcome = "lost: hung (still running after the rest of its group had left; killed)"
                return None
            if deadline is not None and now > deadline:
                for w in members:
                    kill(w)
                _say("killed every process after the --timeout")
                return 124
            if now > next_discovery and first_exit is None and not notices.posted(group):
                next_discovery = now + DISCOVERY_SECONDS
                if more_slots(len(members)):
                    notices.post(group)
                    _say(f"group {group}: more slots reported; the group grows at its next commit")
            time.sleep(0.05)
    except KeyboardInterrupt:
        for w in members:
            kill(w)
        return 130
    finally:
        for w in members:
            if w.proc is not None:
                w.proc.wait()
        output.wait()
