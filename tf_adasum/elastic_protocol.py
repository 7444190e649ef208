"""The elastic launcher's protocol with its processes, in one TensorFlow-free place: what it tells them
through the environment, the exit code of a process that leaves for the next group, the peer timeout,
the notices of added slots (the launcher's NoticeBoard, rank 0's SlotNotices), and the messages of its
pool of warm processes.

The launcher's services answer only the job's processes: they listen on the address the processes reach
the launcher at (127.0.0.1 when every process runs here), and answer only a request that carries the
job's secret, a random token each process gets in its environment (ENV_SECRET), never on a command line.

tf_adasum/elastic_launcher.py (no TensorFlow: it starts in a fraction of a second) and the processes'
side, tf_adasum/elastic_state.py, both import it; so does tf_adasum/errors.py, for the peer timeout.
"""

from __future__ import annotations

import hmac
import http.server
import json
import os
import secrets
import socket
import struct
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

# What the elastic launcher tells each process.
ENV_ELASTIC = "TF_ADASUM_ELASTIC"  # "1" under the elastic launcher
ENV_GENERATION = "TF_ADASUM_ELASTIC_GENERATION"  # 0, 1, ...: the group's number
ENV_STATE_FILE = "TF_ADASUM_ELASTIC_STATE_FILE"  # where this process writes its commits when it leaves
ENV_RESUME_FILE = "TF_ADASUM_ELASTIC_RESUME_FILE"  # a survivor's commits from the last group ("" if none)
ENV_DRIVER = "TF_ADASUM_ELASTIC_DRIVER"  # host:port of the launcher's slot notices
ENV_RESUME_COPY = "TF_ADASUM_ELASTIC_RESUME_COPY"  # the launcher's copy of those commits, to fetch
ENV_SECRET = "TF_ADASUM_ELASTIC_SECRET"  # the job's secret, which the launcher's services ask for
ENV_POOL = "TF_ADASUM_ELASTIC_POOL"  # host:port where a warm process waits for its place in a group
SECRET_HEADER = "X-TF-Adasum-Secret"

# A survivor's exit: "start me again in the next group" (EX_TEMPFAIL).
RESTART_EXIT_CODE = 75

# How long any wait for a peer may last, unless $TF_ADASUM_TIMEOUT_SECONDS says otherwise.
DEFAULT_TIMEOUT_SECONDS = 300.0

# How long a process waits before asking the launcher again after a failed request.
POLL_SECONDS = 1.0

# How long the launcher holds a process's request for the end of its group before it answers "not yet".
ENDED_WAIT_SECONDS = 30.0


def peer_timeout_seconds() -> float:
    """How long any wait for a peer may last: $TF_ADASUM_TIMEOUT_SECONDS, default 300 s."""
    return float(os.environ.get("TF_ADASUM_TIMEOUT_SECONDS", DEFAULT_TIMEOUT_SECONDS))


def launched() -> bool:
    """Whether `python -m tf_adasum.run --elastic` started this process."""
    return os.environ.get(ENV_ELASTIC) == "1"


def generation() -> int:
    """This group's number under the elastic launcher: 0 for the first, one more at every reset."""
    return int(os.environ.get(ENV_GENERATION, "0"))


def new_secret() -> str:
    return secrets.token_hex(16)


def is_secret(given: str | None, secret: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), secret.encode())


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


class NoticeBoard(http.server.ThreadingHTTPServer):
    """The launcher's services, on `address` alone, to requests that carry the job's secret (in the
    SECRET_HEADER header; any other request gets 403 and nothing):

    - GET /updates?generation=G&after=N: the group's latest notice of added slots (0: none), held until
      it is newer than N or ENDED_WAIT_SECONDS passed (without `after`: at once); post(G) posts one;
    - GET /ended?generation=G: held until group G ends (end(G, reason): one of its processes exited
      with an error or to leave), then the reason; after ENDED_WAIT_SECONDS, an empty answer;
    - GET /state?path=P: the launcher's copy of a process's commits, P under `root` (or a folder given
      to serve()), once copied
      (copying(P) announces a copy, copied(P) ends it): how a process whose host lost its own file
      resumes.
    """

    daemon_threads = True

    def __init__(self, address: str, secret: str, root: str) -> None:
        self.notice: dict[int, int] = {}
        self._posted = threading.Condition()
        self.secret = secret
        self.roots = [os.path.realpath(root)]
        self.copies: dict[str, threading.Event] = {}
        self.ends: dict[int, threading.Event] = {}
        self.reasons: dict[int, str] = {}
        self._lock = threading.Lock()
        super().__init__((address, 0), _NoticeHandler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A process that ended while its request was held (a lost one) is no error of the launcher's."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

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

    def serve(self, folder: str) -> None:
        """Serves the files of `folder` too (--resume-from's commits, for processes on other hosts)."""
        self.roots.append(os.path.realpath(folder))

    def copying(self, path: str) -> None:
        self.copies[os.path.realpath(path)] = threading.Event()

    def copied(self, path: str) -> None:
        self.copies.setdefault(os.path.realpath(path), threading.Event()).set()

    def state(self, path: str) -> bytes | None:
        """The copy at `path` (under root), once its copy ended; None for anything else."""
        real = os.path.realpath(path)
        if not any(real.startswith(root + os.sep) for root in self.roots):
            return None
        pending = self.copies.get(real)
        if pending is not None:
            pending.wait(600)
        try:
            with open(real, "rb") as f:
                return f.read()
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


class _NoticeHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if not is_secret(self.headers.get(SECRET_HEADER), self.server.secret):  # type: ignore[attr-defined]
            self.send_response(403)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        url = urllib.parse.urlparse(self.path)
        query = urllib.parse.parse_qs(url.query)
        if url.path == "/state":
            body = self.server.state(query.get("path", [""])[0])  # type: ignore[attr-defined]
            if body is None:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        elif url.path == "/ended":
            group = query.get("generation", [""])[0]
            body = self.server.ended(int(group), ENDED_WAIT_SECONDS).encode() if group.isdigit() else b""  # type: ignore[attr-defined]
        else:
            group = query.get("generation", [""])[0]
            after = query.get("after", [""])[0]
            if not group.isdigit():
                notice = 0
            elif after.isdigit():
                notice = self.server.notice_after(int(group), int(after), ENDED_WAIT_SECONDS)  # type: ignore[attr-defined]
            else:
                notice = self.server.notice.get(int(group), 0)  # type: ignore[attr-defined]
            body = str(notice).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def _hold_open(url: Callable[[], str], secret: str, answered: Callable[[str], bool], name: str) -> None:
    """Starts a thread that holds a request to the launcher's services open, one after another: GET
    url() with the job's secret, for at most ENDED_WAIT_SECONDS and a margin, until `answered(body)`
    returns True. A failed request (the launcher gone or busy) is asked again after POLL_SECONDS."""

    def hold() -> None:
        while True:
            request = urllib.request.Request(url(), headers={SECRET_HEADER: secret})
            try:
                with urllib.request.urlopen(request, timeout=ENDED_WAIT_SECONDS + 10) as answer:
                    body = answer.read().decode()
            except (OSError, ValueError):
                time.sleep(POLL_SECONDS)
                continue
            if answered(body):
                return

    threading.Thread(target=hold, daemon=True, name=name).start()


class SlotNotices:
    """Rank 0's side: a thread holds a request for a newer notice open at the launcher, so that a commit
    reads the latest answer without waiting on the network, and hears of a notice as soon as it is
    posted (a poll every second made a growth wait 0.5 s more on average, issue 42)."""

    def __init__(self, address: str, group: int, secret: str) -> None:
        self.latest = 0
        url = f"http://{address}/updates?generation={group}"
        _hold_open(lambda: f"{url}&after={self.latest}", secret, self._heard, "tf_adasum-elastic-notices")

    def _heard(self, body: str) -> bool:
        if body.isdigit():
            self.latest = max(self.latest, int(body))
        else:  # not the launcher's answer: ask again later
            time.sleep(POLL_SECONDS)
        return False  # hold the next request open


def watch_for_end(on_end: Callable[[str], None]) -> None:
    """Under the launcher: a thread holds a request for the end of this process's group open, and calls
    `on_end(reason)` once the launcher says the group ended (at most once)."""
    address = os.environ.get(ENV_DRIVER)
    if not address:
        return

    def answered(reason: str) -> bool:
        if reason:
            on_end(reason)
        return bool(reason)

    url = f"http://{address}/ended?generation={generation()}"
    _hold_open(lambda: url, os.environ.get(ENV_SECRET, ""), answered, "tf_adasum-elastic-end")


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
    no launcher or no such copy."""
    address = os.environ.get(ENV_DRIVER)
    if not address or not path:
        return None
    request = urllib.request.Request(
        f"http://{address}/state?{urllib.parse.urlencode({'path': path})}",
        headers={SECRET_HEADER: os.environ.get(ENV_SECRET, "")},
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as answer:
            return bytes(answer.read())
    except OSError:
        return None


# The pool's messages: a 4-byte length, then that many bytes of JSON.
def send_message(connection: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    connection.sendall(struct.pack("!I", len(data)) + data)


def receive_message(connection: socket.socket) -> dict[str, Any] | None:
    """The next message, or None when the other side closed the connection."""
    header = _receive_exactly(connection, 4)
    if header is None:
        return None
    data = _receive_exactly(connection, struct.unpack("!I", header)[0])
    return None if data is None else dict(json.loads(data))


def _receive_exactly(connection: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = connection.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
