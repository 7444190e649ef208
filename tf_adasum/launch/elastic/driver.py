"""`python -m tf_adasum.run --elastic`: a job that goes on when workers are lost or slots are added.

The launcher runs the job as a series of groups. A group is a TF_CONFIG cluster of processes with ranks
0..n-1; it ends when every process has exited. A process exits with
- 0: its training function returned (the job is done when every process of the group says so);
- elastic_protocol.RESTART_EXIT_CODE: it survived a lost peer, or the launcher reported new slots;
  its last commits are in its state file (see tf_adasum/elastic.py);
- anything else, or a signal: it is lost. So is a process that has not exited PEER_TIMEOUT + GRACE
  seconds after another of its group did (it hangs: SIGSTOP, a dead host).
The next group takes the survivors first, in their old rank order, each pointed at its state file,
then new processes for free slots, up to --max-np (tf_adasum/launch/elastic/policy.py holds these rules). A
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
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tf_adasum.common.settings import peer_timeout_seconds
from tf_adasum.launch.elastic import policy
from tf_adasum.launch.elastic.commits import job_folder, keep_copy, reseal, resumed_commits
from tf_adasum.launch.elastic.discovery import Discovery
from tf_adasum.launch.elastic.pool import ENV_STANDBY, Pool, Standby
from tf_adasum.launch.hosts import (
    GRACE_SECONDS,
    LOCAL_HOSTS,
    StartError,
    end_all,
    exit_status,
    free_ports,
    start,
    tf_config,
)
from tf_adasum.launch.output import Output
from tf_adasum.launch.private_files import private_directory
from tf_adasum.launch.protocol import NoticeBoard, process_environment
from tf_adasum.launch.secret import new_secret
from tf_adasum.launch.settings import ElasticSettings
from tf_adasum.launch.supervise import Ending, supervise

# A new group waits this long for a warm process that is still importing before starting one cold.
WARM_WAIT_SECONDS = 120.0
# The pool is refilled this long after a group starts (at the launcher's next look at the discovery): the
# new warm processes are forks of the host's fork server, a relay's Python start (~40 ms of CPU) each and
# no import, so they hardly slow the group's own start, and a second change soon after finds them ready.
REFILL_DELAY_SECONDS = 1.0
# Growth waits this long at most for warm processes for every member of the larger group before the
# notice goes out; the group trains meanwhile, and a growth that cannot wait starts processes cold.
GROW_WARM_SECONDS = 60.0
# A new group waits this long at most for the launcher's copies of the survivors' commits (a small file
# each, read through the agent: well under a second on a live host).
COPY_WAIT_SECONDS = 30.0


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


def elastic_launch(settings: ElasticSettings) -> int:
    """Runs settings.command elastically; returns 0 when every process of a group finishes, else the
    failure's exit code (124 after the timeout, 130 on Ctrl-C).

    Raises:
        ValueError: -H with fewer slots than -np, or --resume-from with no commits or no key.
        PermissionError: a folder of the job that another user owns or can write (private_files).
        AuthenticationError: a --resume-from commit that is not its job's.
    """
    discovery = Discovery(settings.discovery_script, settings.hosts, settings.np, settings.discovery_interval)
    if not settings.discovery_script and sum(discovery.static.values()) < settings.np:
        raise ValueError(
            f"-H {settings.hosts!r} has {sum(discovery.static.values())} slots for -np {settings.np}"
        )
    # Every folder the job writes is checked (or made private) before anything starts.
    if settings.state_dir:
        state_dir = private_directory(settings.state_dir, "--state-dir")
    else:
        state_dir = tempfile.mkdtemp(prefix="tf_adasum_elastic-")  # 0700, a name no one can guess
        _say(f"the job's state folder: {state_dir}")
    if settings.output_filename:
        private_directory(settings.output_filename, "--output-filename")
    resumed = resumed_commits(settings.resume_from) if settings.resume_from else {}
    job = ElasticJob(settings, discovery, state_dir)
    try:
        return job.run(resumed)
    finally:
        job.close()


class ElasticJob:
    """One elastic job: its groups, one after another, the launcher's services, and its pool."""

    def __init__(self, settings: ElasticSettings, discovery: Discovery, state_dir: str) -> None:
        self.settings, self.discovery, self.state_dir = settings, discovery, state_dir
        self.command = settings.command
        self.np, self.min_np, self.max_np = settings.np, settings.fewest, settings.most
        self.secret = new_secret()
        job_dir = job_folder(state_dir, self.secret)
        all_local = not discovery.script and all(h in LOCAL_HOSTS for h in discovery.static)
        # The launcher's services listen where the processes reach it, no wider, and answer only holders
        # of the job's key; a process holds at most two requests at once.
        self.address = "127.0.0.1" if all_local else _own_address()
        self.notices = NoticeBoard(self.address, self.secret, job_dir, max_connections=4 * self.max_np + 16)
        self.driver = self.notices.address
        self.env = dict(os.environ, TF_ADASUM_LAUNCHER="1")
        standbys = settings.per_host_standbys
        self.pool = (
            Pool(self.address, self.secret, standbys, settings.agent, self.env, _say) if standbys else None
        )
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

    def run(self, resumed: dict[str, bytes]) -> int:
        """The job's groups, one after another, until one finishes or the job cannot go on."""
        timeout = self.settings.timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.discovery.start()
        self.discovery.first_answer(
            min(self.discovery.timeout, self.settings.elastic_timeout, timeout or 1e9)
        )
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
                members = self.form_group(group, survivors, next_id, lost)
                if isinstance(members, int):
                    return members
                next_id += sum(1 for w in members if not w.resume_file)
                code = self.run_group(group, members)
                if code is None:
                    code = self.group_ended(group, members, lost, resets)
                if code is not None:
                    return code
                survivors = [w for w in members if w.outcome == policy.RESTART]
                resets += 1
                group += 1
        except ElasticError as error:
            _say(str(error))
            return 1

    def group_ended(self, group: int, members: list[Worker], lost: list[Worker], resets: int) -> int | None:
        """What group `group`'s end means for the job: its exit code, or None when a next group starts
        (the survivors' commits then copied to the launcher's host). Counts the lost workers."""
        ended = [w for w in members if w.outcome not in (policy.RESTART, policy.DONE)]
        for w in ended:
            self.blocked[w.host] += 1
            lost.append(w)
        end = policy.group_end([str(w.outcome) for w in members])
        if end is policy.GroupEnd.DONE:
            return 0
        if end is policy.GroupEnd.ALL_FAILED:  # a bug in the script, a bad argument: no one is left
            first = ended[0]
            _say(f"every process of group {group} failed; rank {first.rank} {_described(first)}")
            return first.code if first.code and first.code > 0 else 1
        if end is policy.GroupEnd.FINISHED:  # as Horovod's: not every process finished, so the job failed
            finished = [w.rank for w in members if w.outcome == policy.DONE]
            first = next(w for w in members if w.outcome != policy.DONE)
            _say(
                f"group {group}: rank(s) {finished} finished training, but not every rank did: rank "
                f"{first.rank} {_described(first)}. The job did not finish on every process"
            )
            return exit_status(first.code) if first.outcome != policy.RESTART and first.code else 1
        survivors = [w for w in members if w.outcome == policy.RESTART]
        for w in survivors:  # each resumes from its own file; the launcher keeps a copy
            w.resume_file, w.resume_copy = w.state_file, self.keep_copy(group, w)
        # The copies are here before the next group starts, so a host that loses its disk as its process
        # starts loses no commit (a copy that fails is said; the job goes on from the processes' own).
        self.notices.wait_copied([w.resume_copy for w in survivors], COPY_WAIT_SECONDS)
        _say(
            f"group {group} ended: "
            + ", ".join(f"rank {w.rank} ({w.id}@{w.host}) {w.outcome}" for w in members)
        )
        limit = self.settings.reset_limit
        if limit is not None and resets + 1 > limit:
            last = ended[-1] if ended else (lost[-1] if lost else None)
            why = (
                f"{last.id} on {last.host}: {last.outcome}; its last output: {_last_error(last)}"
                if last
                else ""
            )
            _say(f"more than --reset-limit {limit} resets; the last lost worker was {why}")
            return last.code if last and last.code and last.code > 0 else 1
        return None

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
        self, group: int, survivors: list[Worker], next_id: int, lost: list[Worker]
    ) -> list[Worker] | int:
        """The next group's members: the survivors that still have a slot, then new processes; or the
        exit code that ends the job (the timeout)."""
        elastic_timeout = self.settings.elastic_timeout
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
        agent = self.settings.agent
        keep_copy(self.notices, worker.host, worker.state_file, copy, self.secret, self.env, agent, _say)
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
        worker.proc = start(worker.host, self.command, env, self.settings.agent)
        return False

    def start_group(
        self, group: int, members: list[Worker], workers: list[str], group_dir: str
    ) -> tuple[Output, int]:
        """Starts every member of group `group`, their output followed; returns the output and how many
        came warm from the pool. Where one cannot start, those started are ended (StartError)."""
        output_filename = self.settings.output_filename
        output = Output(
            os.path.join(output_filename, f"group{group}") if output_filename else None, ranks=len(members)
        )
        warm_until = time.monotonic() + WARM_WAIT_SECONDS
        warm = 0
        try:
            for rank, w in enumerate(members):
                w.rank, w.outcome, w.code, w.proc = rank, None, None, None
                w.state_file = os.path.join(group_dir, f"rank{rank}-{w.id}.pkl")
                env = dict(self.env)
                env["TF_CONFIG"] = tf_config(workers, rank)
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
        """Runs one group to its end (launch/supervise.py); sets each worker's outcome. Returns an exit
        code that ends the job (the timeout, Ctrl-C), or None."""
        ports = free_ports(len(members))
        workers = [f"{w.host}:{port}" for w, port in zip(members, ports, strict=True)]
        _say(
            f"group {group}: {len(members)} process(es): "
            + ", ".join(
                f"rank {r} {w.id}@{w.host}{' (resumes)' if w.resume_file else ''}"
                for r, w in enumerate(members)
            )
        )
        output, warm = self.start_group(
            group, members, workers, os.path.join(self.state_dir, f"group{group}")
        )
        if self.pool is not None:
            _say(f"group {group}: {warm} process(es) from the pool, {len(members) - warm} started cold")

        def exited(index: int, code: int) -> None:
            w = members[index]
            w.code, w.outcome = code, policy.process_outcome(code)
            if code != 0:  # the others may wait on a peer that lives but is leaving too: end their
                # collectives now, rather than when TensorFlow notices (seconds later)
                self.notices.end(group, f"rank {w.rank} ({w.id}@{w.host}) {w.outcome}")

        def hung(now: float, first_exit: float, last_alone: float | None) -> bool:
            return policy.hung(now, first_exit, last_alone, peer_timeout_seconds(), GRACE_SECONDS)

        try:
            ending = supervise(
                [w.proc for w in members], self.deadline, hung, exited, self.watcher(group, members)
            )
        finally:
            output.wait()
        return self.ending(ending, members)

    def ending(self, ending: Ending, members: list[Worker]) -> int | None:
        """The job's exit code for how the group's processes ended, or None for the next group; the killed
        ones' outcomes."""
        for i in ending.killed:
            members[i].code = ending.codes[i]
            members[i].outcome = "lost: hung (still running after the rest of its group had left; killed)"
        if ending.how == "timeout":
            _say("killed every process after the --timeout")
            return 124
        return 130 if ending.how == "interrupted" else None

    def watcher(self, group: int, members: list[Worker]) -> Callable[[float, float | None], None]:
        """What the launcher does while a group trains, at every discovery period: post a notice when
        more slots are reported (once warm processes are ready for the larger group), and keep the pool
        full (from REFILL_DELAY_SECONDS after the group's start)."""
        started = time.monotonic()
        next_look = started + self.discovery.interval
        grow_seen: float | None = None  # when more slots were first seen
        refilled = self.pool is None

        def tick(now: float, first_exit: float | None) -> None:
            nonlocal next_look, grow_seen, refilled
            if now < next_look:
                return
            next_look = now + self.discovery.interval
            if first_exit is None and not self.notices.posted(group) and self.more_slots(len(members)):
                grow_seen = grow_seen or now
                if self.warm_for_growth(members) or now > grow_seen + GROW_WARM_SECONDS:
                    self.notices.post(group)
                    _say(f"group {group}: more slots reported; the group grows at its next commit")
            if self.pool is not None:
                self.pool.reap()
                refilled = refilled or now > started + REFILL_DELAY_SECONDS
                if refilled and self.last_answer:
                    self.pool.fill(self.pool_target())

        return tick


def _described(worker: Worker) -> str:
    return f"({worker.id}@{worker.host}) {worker.outcome}; its last output: {_last_error(worker)}"


def _last_error(worker: Worker) -> str:
    lines = [line for line in worker.tail if line.strip()]
    return lines[-1] if lines else "(no output)"


def _own_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
