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
every --host-discovery-interval seconds, 1 by default) or from -H. When the script reports more slots
than the group uses, and the group is smaller than --max-np, the launcher posts a notice; rank 0 reads
it, and every rank leaves at the next commit, so the next group is larger.

No TensorFlow here: the launcher starts in a fraction of a second.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from tf_adasum import elastic_policy as policy
from tf_adasum.elastic_commits import job_folder, keep_copy, reseal, resumed_commits
from tf_adasum.elastic_discovery import DEFAULT_INTERVAL_SECONDS, Discovery
from tf_adasum.elastic_pool import ENV_STANDBY, Pool, Standby
from tf_adasum.elastic_protocol import NoticeBoard, process_environment
from tf_adasum.hosts import (
    DEFAULT_AGENT,
    GRACE_SECONDS,
    LOCAL_HOSTS,
    StartError,
    check_sizes,
    end_all,
    exit_status,
    free_ports,
    start,
)
from tf_adasum.launch_output import Output
from tf_adasum.private_files import private_directory
from tf_adasum.secret import new_secret
from tf_adasum.settings import peer_timeout_seconds

# A new group waits this long for a warm process that is still importing before starting one cold.
WARM_WAIT_SECONDS = 120.0
# The pool is refilled this long after a group starts (at the launcher's next look at the discovery): the
# new warm processes are forks of the host's fork server, a relay's Python start (~40 ms of CPU) each and
# no import, so they hardly slow the group's own start, and a second change soon after finds them ready.
REFILL_DELAY_SECONDS = 1.0
# Growth waits this long at most for warm processes for every member of the larger group before the
# notice goes out; the group trains meanwhile, and a growth that cannot wait starts processes cold.
GROW_WARM_SECONDS = 60.0


class ElasticError(RuntimeError):
    """The job cannot go on: too few workers."""


@dataclass
class Worker:
    id: str
    host: str
    resume_file: str = ""  # its commits from the last group, on its own host
    resume_copy: str = ""  # the launcher's copy of them, on the launcher's host
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
    discovery_interval: float = DEFAULT_INTERVAL_SECONDS,
    reset_limit: int | None = None,
    elastic_timeout: float = 600.0,
    timeout: float | None = None,
    agent: str = DEFAULT_AGENT,
    state_dir: str | None = None,
    resume_from: str | None = None,
    output_filename: str | None = None,
    standbys: int | None = None,
) -> int:
    """Runs `command` elastically; returns 0 when a group finishes, else the failure's exit code.

    Args:
        np: the first group's size.
        command: what each process runs.
        min_np: the fewest workers the job goes on with (default np).
        max_np: the most workers (default np).
        hosts: -H host:slots,... (without a discovery script); default np slots on 127.0.0.1.
        discovery_script: prints the available host:slots lines; run every `discovery_interval` seconds.
        discovery_interval: the seconds between two runs of the discovery script (1, as Horovod's).
        reset_limit: how many resets (new groups after the first) the job may take; None: any number.
        elastic_timeout: how long to wait for min_np slots before giving up.
        timeout: seconds after which everything is killed (exit code 124).
        agent: how a process starts on another host.
        state_dir: where processes write their commits when they leave a group (on their own host); the
            launcher keeps a copy of every commit in STATE_DIR/job/group<g> (on its own host).
        resume_from: an earlier job's STATE_DIR/job/group<g>: the first group resumes from its commits.
        output_filename: a folder for each process's stdout and stderr: DIR/group<g>/rank.<r>/.
        standbys: warm processes kept waiting on each host (tf_adasum/elastic_pool.py); None: as many as
            the host has slots; 0: every process starts cold.
    """
    sizes = {"elastic_timeout": elastic_timeout, "reset_limit": reset_limit, "standbys": standbys}
    min_np, max_np = check_sizes(np, timeout, min_np, max_np, **sizes)
    discovery = Discovery(discovery_script, hosts, np, discovery_interval)
    if not discovery_script and sum(discovery.static.values()) < np:
        raise ValueError(f"-H {hosts!r} has {sum(discovery.static.values())} slots for -np {np}")
    # Every folder the job writes is checked (or made private) before anything starts.
    if state_dir:
        state_dir = private_directory(state_dir, "--state-dir")
    else:
        state_dir = tempfile.mkdtemp(prefix="tf_adasum_elastic-")  # 0700, a name no one can guess
        _say(f"the job's state folder: {state_dir}")
    if output_filename:
        private_directory(output_filename, "--output-filename")
    resumed = resumed_commits(resume_from) if resume_from else {}
    job = ElasticJob(
        command,
        discovery,
        np,
        min_np,
        max_np,
        state_dir,
        agent,
        output_filename,
        max_np if standbys is None else standbys,
    )
    try:
        return job.run(reset_limit, elastic_timeout, timeout, resumed)
    finally:
        job.close()


class ElasticJob:
    """One elastic job: its groups, one after another, the launcher's services, and its pool."""

    def __init__(
        self,
        command: list[str],
        discovery: Discovery,
        np: int,
        min_np: int,
        max_np: int,
        state_dir: str,
        agent: str,
        output_filename: str | None,
        standbys: int,
    ) -> None:
        self.command, self.discovery, self.agent = command, discovery, agent
        self.np, self.min_np, self.max_np = np, min_np, max_np
        self.state_dir, self.output_filename = state_dir, output_filename
        self.secret = new_secret()
        job_dir = job_folder(state_dir, self.secret)
        all_local = not discovery.script and all(h in LOCAL_HOSTS for h in discovery.static)
        # The launcher's services listen where the processes reach it, no wider, and answer only holders
        # of the job's key; a process holds at most two requests at once.
        self.address = "127.0.0.1" if all_local else _own_address()
        self.notices = NoticeBoard(self.address, self.secret, job_dir, max_connections=4 * max_np + 16)
        self.driver = self.notices.address
        self.env = dict(os.environ, TF_ADASUM_LAUNCHER="1")
        self.pool = Pool(self.address, self.secret, standbys, agent, self.env, _say) if standbys > 0 else None
        self.blocked: collections.Counter[str] = collections.Counter()
        self.last_answer: dict[str, int] | None = None
        self.most_slots: collections.Counter[str] = collections.Counter()
        self.deadline: float | None = None

    def close(self) -> None:
        self.discovery.close()
        self.notices.close()
        if self.pool is not None:
            self.pool.close()

    def answer(self) -> dict[str, int]:
        """The discovery's answer; a changed answer frees the slots of lost workers."""
        answer = self.discovery.slots()
        if self.discovery.script and self.last_answer is not None and answer != self.last_answer:
            self.blocked.clear()
        self.last_answer = answer
        for host, count in answer.items():
            self.most_slots[host] = max(self.most_slots[host], count)
        return answer

    def pool_target(self) -> dict[str, int]:
        """The slots the pool keeps warm processes for: each listed host's most slots so far, so that a
        host whose slots come back finds its processes warm."""
        return {host: self.most_slots[host] for host in self.last_answer or {}}

    def more_slots(self, in_use: int) -> bool:
        # At max_np nothing is asked: the answer then stays the one the group formed with, and a change
        # seen once the group ends (a lost worker's host leaving the list) frees the lost slots.
        if not self.discovery.script or in_use >= self.max_np:
            return False
        return policy.has_more_slots(self.answer(), self.blocked, in_use, self.max_np)

    def run(
        self,
        reset_limit: int | None,
        elastic_timeout: float,
        timeout: float | None,
        resumed: dict[str, bytes],
    ) -> int:
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.discovery.start()
        self.discovery.first_answer(min(self.discovery.timeout, elastic_timeout, timeout or elastic_timeout))
        survivors = self.resume(resumed)
        lost: list[Worker] = []
        next_id, group, resets = 0, 0, 0
        if self.pool is not None:
            # The first group's processes and, besides, a full pool for the first change.
            answer = self.answer()
            starting = policy.choose_members(answer, self.blocked, [w.host for w in survivors], self.np)
            self.pool.fill(
                answer, collections.Counter([survivors[i].host for i in starting.kept] + starting.new_hosts)
            )
        try:
            while True:
                members = self.form_group(group, survivors, next_id, lost, elastic_timeout)
                if isinstance(members, int):
                    return members
                next_id += sum(1 for w in members if not w.resume_file)
                code = self.run_group(group, members)
                if code is not None:
                    return code
                ended = [w for w in members if w.outcome not in (policy.RESTART, policy.DONE)]
                for w in ended:
                    self.blocked[w.host] += 1
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
                    # As Horovod's: a job whose processes did not all finish did not succeed.
                    finished = [w.rank for w in members if w.outcome == policy.DONE]
                    first = next(w for w in members if w.outcome != policy.DONE)
                    _say(
                        f"group {group}: rank(s) {finished} finished training, but not every rank did: rank "
                        f"{first.rank} ({first.id}@{first.host}) {first.outcome}; its last output: "
                        f"{_last_error(first)}. The job did not finish on every process"
                    )
                    return exit_status(first.code) if first.outcome != policy.RESTART and first.code else 1
                for w in survivors:  # each resumes from its own file; the launcher keeps a copy
                    w.resume_file, w.resume_copy = w.state_file, self.keep_copy(group, w)
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

    def resume(self, resumed: dict[str, bytes]) -> list[Worker]:
        """The first group's survivors, from --resume-from's commits, in the first slots in order: each
        resumes from a copy sealed anew under this job's key (elastic_commits.reseal), which is served to
        one on another host (elastic_protocol.fetch_state)."""
        slots = [host for host, count in self.answer().items() for _ in range(count)] or ["127.0.0.1"]
        survivors = []
        for i, (name, path) in enumerate(reseal(self.state_dir, resumed, self.secret).items()):
            survivors.append(Worker(id=name.split("-", 1)[1][:-4], host=slots[i % len(slots)]))
            survivors[-1].resume_file = survivors[-1].resume_copy = path
        return survivors

    def form_group(
        self, group: int, survivors: list[Worker], next_id: int, lost: list[Worker], elastic_timeout: float
    ) -> list[Worker] | int:
        """The next group's members: the survivors that still have a slot, then new processes; or the
        exit code that ends the job (the timeout)."""
        wait_until = time.monotonic() + elastic_timeout
        while True:
            chosen = policy.choose_members(
                self.answer(),
                self.blocked,
                [w.host for w in survivors],
                self.np if group == 0 else self.max_np,
            )
            if chosen.size >= self.min_np:
                members = [survivors[i] for i in chosen.kept]
                return members + [
                    Worker(id=f"w{next_id + i}", host=h) for i, h in enumerate(chosen.new_hosts)
                ]
            if self.deadline is not None and time.monotonic() > self.deadline:
                _say("the --timeout passed while waiting for slots")
                return 124
            if time.monotonic() > wait_until:
                gone = "; ".join(f"{w.id} on {w.host} (rank {w.rank}): {w.outcome}" for w in lost) or "none"
                raise ElasticError(
                    f"{chosen.size} worker(s) available, fewer than --min-np {self.min_np}, "
                    f"after waiting {elastic_timeout:.0f} s for slots. Lost workers: {gone}. "
                    f"The last commits are in {self.job_dir(max(group - 1, 0))} "
                    "(resume with --resume-from)"
                )
            time.sleep(self.discovery.interval)

    def job_dir(self, group: int) -> str:
        """Where the launcher keeps a copy of group `group`'s commits, on its own host."""
        return os.path.join(self.state_dir, "job", f"group{group}")

    def keep_copy(self, group: int, worker: Worker) -> str:
        """A survivor's commits copied to the launcher's host, in the background (elastic_commits), so
        that losing its host loses none of them; returns the copy's path."""
        copy = os.path.join(self.job_dir(group), os.path.basename(worker.state_file))
        keep_copy(self.notices, worker.host, worker.state_file, copy, self.secret, self.env, self.agent, _say)
        return copy

    def warm_for_growth(self, members: list[Worker]) -> bool:
        """Whether the pool holds a ready process for every member of the larger group (all its members
        restart); if not, it starts what is missing. True without a pool."""
        answer = self.last_answer or {}
        bigger = policy.choose_members(answer, self.blocked, [w.host for w in members], self.max_np)
        need = collections.Counter([members[i].host for i in bigger.kept] + bigger.new_hosts)
        return self.pool is None or self.pool.ready_for(need)

    def start_member(self, worker: Worker, env: dict[str, str], warm_until: float) -> bool:
        """Starts a member's process: a warm one from the pool where the host has one (waiting, if need
        be, for one still importing), else a cold one, said so. Returns whether it was warm; a warm
        one finds its standby's id in its environment (ENV_STANDBY)."""
        standby: Standby | None = None
        if self.pool is not None:
            standby = self.pool.take_when_ready(worker.host, warm_until)
            if standby is None:
                _say(f"no warm process on {worker.host} for {worker.id}: it starts cold")
        if standby is not None:
            assert self.pool is not None
            worker.proc = self.pool.assign(standby, {**env, ENV_STANDBY: standby.id}, self.command)
            return True
        worker.proc = start(worker.host, self.command, env, self.agent)
        return False

    def start_group(
        self, group: int, members: list[Worker], workers: list[str], group_dir: str
    ) -> tuple[Output, int]:
        """Starts every member of group `group`, their output followed; returns the output and how many
        came warm from the pool. Where one cannot start, those started are ended (StartError)."""
        output = Output(
            os.path.join(self.output_filename, f"group{group}") if self.output_filename else None,
            ranks=len(members),
        )
        warm_until = time.monotonic() + WARM_WAIT_SECONDS
        warm = 0
        try:
            for rank, w in enumerate(members):
                w.rank, w.outcome, w.code, w.proc = rank, None, None, None
                w.state_file = os.path.join(group_dir, f"rank{rank}-{w.id}.pkl")
                env = dict(self.env)
                env["TF_CONFIG"] = json.dumps(
                    {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}
                )
                env.update(
                    process_environment(
                        group, w.state_file, w.resume_file, w.resume_copy, self.driver, self.secret
                    )
                )
                try:
                    warm += self.start_member(w, env, warm_until)
                except OSError as error:
                    raise StartError(
                        f"group {group}: could not start rank {rank} ({w.id}) on {w.host}: {error}; the "
                        f"{rank} process(es) already started were ended"
                    ) from error
                output.follow(rank, w.proc.stdout, w.proc.stderr, w.tail)
        except BaseException:
            end_all([w.proc for w in members if w.proc is not None])
            output.close()
            output.wait()
            raise
        return output, warm

    def run_group(self, group: int, members: list[Worker]) -> int | None:
        """Runs one group to its end; sets each worker's outcome. Returns an exit code that ends the job
        (the timeout, Ctrl-C), or None."""
        ports = free_ports(len(members))
        workers = [f"{w.host}:{port}" for w, port in zip(members, ports, strict=True)]
        group_dir = os.path.join(self.state_dir, f"group{group}")
        _say(
            f"group {group}: {len(members)} process(es): "
            + ", ".join(
                f"rank {r} {w.id}@{w.host}{' (resumes)' if w.resume_file else ''}"
                for r, w in enumerate(members)
            )
        )
        output, warm = self.start_group(group, members, workers, group_dir)
        if self.pool is not None:
            _say(f"group {group}: {warm} process(es) from the pool, {len(members) - warm} started cold")
        started = time.monotonic()
        refilled = self.pool is None

        first_exit: float | None = None
        last_alone: float | None = None
        grow_seen: float | None = None  # when more slots were first seen
        next_discovery = time.monotonic() + self.discovery.interval
        try:
            while True:
                now = time.monotonic()
                for w in members:
                    if w.outcome is None and w.proc.poll() is not None:
                        w.code = w.proc.returncode
                        w.outcome = policy.process_outcome(w.code)
                        if w.code != 0 and first_exit is None:
                            first_exit = now
                            # The others may wait on a peer that lives but is leaving too: end their
                            # collectives now, rather than when TensorFlow notices (seconds, issue 42).
                            self.notices.end(group, f"rank {w.rank} ({w.id}@{w.host}) {w.outcome}")
                if all(w.outcome is not None for w in members):
                    return None
                running = [w for w in members if w.outcome is None]
                if first_exit is not None and len(running) == 1 and last_alone is None:
                    last_alone = now
                if policy.hung(now, first_exit, last_alone, peer_timeout_seconds(), GRACE_SECONDS):
                    end_all([w.proc for w in running])
                    for w in running:
                        w.code = w.proc.returncode
                        w.outcome = "lost: hung (still running after the rest of its group had left; killed)"
                    return None
                if self.deadline is not None and now > self.deadline:
                    end_all([w.proc for w in members])
                    _say("killed every process after the --timeout")
                    return 124
                if now > next_discovery:
                    next_discovery = now + self.discovery.interval
                    if (
                        first_exit is None
                        and not self.notices.posted(group)
                        and self.more_slots(len(members))
                    ):
                        grow_seen = grow_seen or now
                        if self.warm_for_growth(members) or now > grow_seen + GROW_WARM_SECONDS:
                            self.notices.post(group)
                            _say(f"group {group}: more slots reported; the group grows at its next commit")
                    if self.pool is not None:
                        self.pool.reap()
                        if not refilled and now > started + REFILL_DELAY_SECONDS:
                            refilled = True
                        if refilled and self.last_answer:
                            self.pool.fill(self.pool_target())
                time.sleep(0.05)
        except KeyboardInterrupt:
            end_all([w.proc for w in members])
            return 130
        finally:
            end_all([w.proc for w in members if w.proc.poll() is None])
            output.wait()


def _last_error(worker: Worker) -> str:
    lines = [line for line in worker.tail if line.strip()]
    return lines[-1] if lines else "(no output)"


def _own_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
