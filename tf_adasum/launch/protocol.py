"""The elastic launcher's protocol with its processes, in one TensorFlow-free place: what it tells them
through the environment, the exit code of a process that leaves for the next group, the peer timeout,
and the launcher's services (the NoticeBoard; rank 0's SlotNotices, every process's end watch, the
fetch of a commit's copy).

The launcher's services answer only the job's processes: they listen on the address the processes reach
the launcher at (127.0.0.1 when every process runs here), and talk only to a peer that proves it holds
the job's key, and prove it back (secret.Channel): the key itself, in each process's environment
(ENV_SECRET) and never on a command line, never crosses a socket.

tf_adasum/launch/elastic/driver.py (no TensorFlow: it starts in a fraction of a second) and the processes'
side, tf_adasum/elastic/state.py, both import it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from tf_adasum.launch.private_files import read_private
from tf_adasum.launch.secret import ENV_SECRET, AuthenticationError, Channel
from tf_adasum.launch.service import Service, ask

# What the elastic launcher tells each process.
ENV_ELASTIC = "TF_ADASUM_ELASTIC"  # "1" under the elastic launcher
ENV_GENERATION = "TF_ADASUM_ELASTIC_GENERATION"  # 0, 1, ...: the group's number
ENV_STATE_FILE = "TF_ADASUM_ELASTIC_STATE_FILE"  # where this process writes its commits when it leaves
ENV_RESUME_FILE = "TF_ADASUM_ELASTIC_RESUME_FILE"  # a survivor's commits from the last group ("" if none)
ENV_DRIVER = "TF_ADASUM_ELASTIC_DRIVER"  # host:port of the launcher's services
ENV_RESUME_COPY = "TF_ADASUM_ELASTIC_RESUME_COPY"  # the launcher's copy of those commits, to fetch
ENV_POOL = "TF_ADASUM_ELASTIC_POOL"  # host:port where a warm process waits for its place in a group

# A survivor's exit: "start me again in the next group" (EX_TEMPFAIL).
RESTART_EXIT_CODE = 75

# How long a process waits before asking the launcher again after a failed request.
POLL_SECONDS = 1.0

# How long the launcher holds a process's request for the end of its group before it answers "not yet".
ENDED_WAIT_SECONDS = 30.0

# How long the launcher may take to send a commit's copy, and the largest it sends.
STATE_SEND_SECONDS = 600.0
MAX_COMMIT_BYTES = 1 << 40


def launched() -> bool:
    """Whether `python -m tf_adasum.run --elastic` started this process."""
    return os.environ.get(ENV_ELASTIC) == "1"


def generation() -> int:
    """This group's number under the elastic launcher: 0 for the first, one more at every reset."""
    return int(os.environ.get(ENV_GENERATION, "0"))


def process_environment(
    group: int, state_file: str, resume_file: str, resume_copy: str, driver: str, secret: str
) -> dict[str, str]:
    """What the launcher puts in a process's environment for group `group`."""
    return {
        ENV_ELASTIC: "1",
        ENV_GENERATION: str(group),
        ENV_STATE_FILE: state_file,
        ENV_RESUME_FILE: resume_file,
        ENV_RESUME_COPY: resume_copy,
        ENV_DRIVER: driver,
        ENV_SECRET: secret,
    }


class NoticeBoard(Service):
    """The launcher's services, on `address` alone, to holders of the job's key (service.Service), one
    request a connection:

    - {"ask": "updates", "generation": G, "after": N}: the group's latest notice of added slots (0: none),
      held until it is newer than N or ENDED_WAIT_SECONDS passed (without "after": at once); post(G)
      posts one;
    - {"ask": "ended", "generation": G}: held until group G ends (end(G, reason): one of its processes
      exited with an error or to leave), then the reason; after ENDED_WAIT_SECONDS, "";
    - {"ask": "state", "path": P}: the launcher's copy of a process's commits, P under `root`, once
      copied (copying(P) announces a copy, copied(P) ends it), as the answer's blob: how a process whose
      host lost its own file resumes.

    `max_connections` bounds the requests held at once (a process holds at most two).
    """

    def __init__(self, address: str, secret: str, root: str, max_connections: int = 64) -> None:
        self.notice: dict[int, int] = {}
        self._posted = threading.Condition()
        self.root = os.path.realpath(root)
        self.copies: dict[str, threading.Event] = {}
        self.ends: dict[int, threading.Event] = {}
        self.reasons: dict[int, str] = {}
        self._lock = threading.Lock()
        super().__init__(address, secret, max_connections, "tf_adasum-elastic-notices")

    def handle(self, channel: Channel) -> bool:
        request, _ = channel.receive()
        ask, group = request.get("ask"), request.get("generation")
        blob = b""
        if ask == "state":
            data = self.state(str(request.get("path", "")))
            answer: dict[str, Any] = {"found": data is not None}
            blob = data or b""
        elif not isinstance(group, int):
            answer = {"error": f"expected an integer generation, got {group!r}"}
        elif ask == "ended":
            answer = {"reason": self.ended(group, ENDED_WAIT_SECONDS)}
        elif ask == "updates":
            after = request.get("after")
            if isinstance(after, int):
                answer = {"notice": self.notice_after(group, after, ENDED_WAIT_SECONDS)}
            else:
                answer = {"notice": self.notice.get(group, 0)}
        else:
            answer = {"error": f"unknown request {ask!r}"}
        channel.connection.settimeout(STATE_SEND_SECONDS)  # a large commit takes its time
        channel.send(answer, blob)
        return False

    def end(self, group: int, reason: str) -> None:
        """Tells group `group`'s processes that it ended, and why (the first reason given stays)."""
        with self._lock:
            self.reasons.setdefault(group, reason)
            self.ends.setdefault(group, threading.Event()).set()

    def ended(self, group: int, wait: float) -> str:
        """Why group `group` ended, once it has, waiting at most `wait` seconds; "" if it has not."""
        with self._lock:
            event = self.ends.setdefault(group, threading.Event())
        event.wait(wait)
        return self.reasons.get(group, "")

    def copying(self, path: str) -> None:
        self.copies[os.path.realpath(path)] = threading.Event()

    def copied(self, path: str) -> None:
        self.copies.setdefault(os.path.realpath(path), threading.Event()).set()

    def wait_copied(self, paths: list[str], seconds: float) -> None:
        """Waits until every copy of `paths` has ended (made or failed), at most `seconds` in all."""
        deadline = time.monotonic() + seconds
        for path in paths:
            pending = self.copies.get(os.path.realpath(path))
            if pending is not None:
                pending.wait(max(0.0, deadline - time.monotonic()))

    def state(self, path: str) -> bytes | None:
        """The copy at `path` (under root), once its copy ended; None for anything else."""
        real = os.path.realpath(path)
        if not real.startswith(self.root + os.sep):
            return None
        pending = self.copies.get(real)
        if pending is not None:
            pending.wait(600)
        try:
            return read_private(real)
        except OSError:
            return None

    def post(self, group: int) -> None:
        with self._posted:
            self.notice[group] = time.time_ns()
            self._posted.notify_all()

    def notice_after(self, group: int, after: int, wait: float) -> int:
        """Group `group`'s latest notice, once it is newer than `after`, waiting at most `wait` seconds."""
        with self._posted:
            self._posted.wait_for(lambda: self.notice.get(group, 0) > after, wait)
            return self.notice.get(group, 0)

    def posted(self, group: int) -> bool:
        return bool(self.notice.get(group))


def _hold_open(
    address: str,
    secret: str,
    request: Callable[[], dict[str, Any]],
    answered: Callable[[dict[str, Any]], bool],
    name: str,
) -> None:
    """Starts a thread that holds a request to the launcher's services open, one after another: request()
    at `address`, answered within ENDED_WAIT_SECONDS and a margin, until `answered(answer)` returns True.
    A failed request (the launcher gone or busy, or not the launcher) is asked again after POLL_SECONDS."""

    def hold() -> None:
        while True:
            try:
                answer, _ = ask(address, secret, request(), ENDED_WAIT_SECONDS + 10)
            except (OSError, ValueError):
                time.sleep(POLL_SECONDS)
                continue
            if answered(answer):
                return

    threading.Thread(target=hold, daemon=True, name=name).start()


class SlotNotices:
    """Rank 0's side: a thread holds a request for a newer notice open at the launcher, so that a commit
    reads the latest answer without waiting on the network, and hears of a notice as soon as it is
    posted."""

    def __init__(self, address: str, group: int, secret: str) -> None:
        self.latest = 0
        request = lambda: {"ask": "updates", "generation": group, "after": self.latest}  # noqa: E731
        _hold_open(address, secret, request, self._heard, "tf_adasum-elastic-notices")

    def _heard(self, answer: dict[str, Any]) -> bool:
        notice = answer.get("notice")
        if isinstance(notice, int):
            self.latest = max(self.latest, notice)
        else:  # not an answer to this request: ask again later
            time.sleep(POLL_SECONDS)
        return False  # hold the next request open


def watch_for_end(on_end: Callable[[str], None]) -> None:
    """Under the launcher: a thread holds a request for the end of this process's group open, and calls
    `on_end(reason)` once the launcher says the group ended (at most once)."""
    address = os.environ.get(ENV_DRIVER)
    if not address:
        return

    def answered(answer: dict[str, Any]) -> bool:
        reason = str(answer.get("reason") or "")
        if reason:
            on_end(reason)
        return bool(reason)

    request = {"ask": "ended", "generation": generation()}
    _hold_open(address, os.environ.get(ENV_SECRET, ""), lambda: request, answered, "tf_adasum-elastic-end")


_notices: SlotNotices | None = None


def latest_notice() -> int:
    """The latest notice of added slots this process has heard of (rank 0 asks; 0 outside the launcher)."""
    global _notices
    address = os.environ.get(ENV_DRIVER)
    if not address:
        return 0
    if _notices is None:
        _notices = SlotNotices(address, generation(), os.environ.get(ENV_SECRET, ""))
    return _notices.latest


def fetch_state(path: str) -> bytes | None:
    """The launcher's copy of commits at `path` (ENV_RESUME_COPY), from its services; None where there is
    no launcher or no such copy.

    Raises:
        AuthenticationError: what answers at the launcher's address is not this job's launcher.
    """
    address = os.environ.get(ENV_DRIVER)
    if not address or not path:
        return None
    try:
        answer, blob = ask(
            address, os.environ.get(ENV_SECRET, ""), {"ask": "state", "path": path}, 600, MAX_COMMIT_BYTES
        )
    except AuthenticationError:
        raise
    except OSError:
        return None
    return blob if answer.get("found") else None
