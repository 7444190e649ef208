"""The elastic launcher's protocol with its processes, in one TensorFlow-free place: what it tells them
through the environment, the exit code of a process that leaves for the next group, the peer timeout,
and the notices of added slots (the launcher's NoticeBoard, rank 0's SlotNotices).

tf_adasum/elastic_launcher.py (no TensorFlow: it starts in a fraction of a second) and the processes'
side, tf_adasum/elastic_state.py, both import it; so does tf_adasum/errors.py, for the peer timeout.
"""

from __future__ import annotations

import http.server
import os
import threading
import time
import urllib.request
from typing import Any

# What the elastic launcher tells each process.
ENV_ELASTIC = "TF_ADASUM_ELASTIC"  # "1" under the elastic launcher
ENV_GENERATION = "TF_ADASUM_ELASTIC_GENERATION"  # 0, 1, ...: the group's number
ENV_STATE_FILE = "TF_ADASUM_ELASTIC_STATE_FILE"  # where this process writes its commits when it leaves
ENV_RESUME_FILE = "TF_ADASUM_ELASTIC_RESUME_FILE"  # a survivor's commits from the last group ("" if none)
ENV_DRIVER = "TF_ADASUM_ELASTIC_DRIVER"  # host:port of the launcher's slot notices

# A survivor's exit: "start me again in the next group" (EX_TEMPFAIL).
RESTART_EXIT_CODE = 75

# How long any wait for a peer may last, unless $TF_ADASUM_TIMEOUT_SECONDS says otherwise.
DEFAULT_TIMEOUT_SECONDS = 300.0

# How often rank 0 asks the launcher whether slots were added.
POLL_SECONDS = 1.0


def peer_timeout_seconds() -> float:
    """How long any wait for a peer may last: $TF_ADASUM_TIMEOUT_SECONDS, default 300 s."""
    return float(os.environ.get("TF_ADASUM_TIMEOUT_SECONDS", DEFAULT_TIMEOUT_SECONDS))


def launched() -> bool:
    """Whether `python -m tf_adasum.run --elastic` started this process."""
    return os.environ.get(ENV_ELASTIC) == "1"


def generation() -> int:
    """This group's number under the elastic launcher: 0 for the first, one more at every reset."""
    return int(os.environ.get(ENV_GENERATION, "0"))


def process_environment(group: int, state_file: str, resume_file: str, driver: str) -> dict[str, str]:
    """What the launcher puts in a process's environment for group `group`."""
    return {
        ENV_ELASTIC: "1",
        ENV_GENERATION: str(group),
        ENV_STATE_FILE: state_file,
        ENV_RESUME_FILE: resume_file,
        ENV_DRIVER: driver,
    }


class NoticeBoard(http.server.ThreadingHTTPServer):
    """The launcher's side: answers rank 0's GET /updates?generation=G with the group's latest notice of
    added slots (0: none). post(G) posts one."""

    daemon_threads = True

    def __init__(self) -> None:
        self.notice: dict[int, int] = {}
        super().__init__(("0.0.0.0", 0), _NoticeHandler)

    def post(self, group: int) -> None:
        self.notice[group] = time.time_ns()

    def posted(self, group: int) -> bool:
        return bool(self.notice.get(group))


class _NoticeHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        group = self.path.rpartition("generation=")[2]
        value = self.server.notice.get(int(group), 0) if group.isdigit() else 0  # type: ignore[attr-defined]
        body = str(value).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class SlotNotices:
    """Rank 0's side: a thread asks the launcher every POLL_SECONDS, so that a commit reads the latest
    answer without waiting on the network."""

    def __init__(self, address: str, group: int) -> None:
        self.latest = 0
        self._url = f"http://{address}/updates?generation={group}"
        threading.Thread(target=self._poll, daemon=True, name="tf_adasum-elastic-notices").start()

    def _poll(self) -> None:
        while True:
            try:
                with urllib.request.urlopen(self._url, timeout=5) as answer:
                    self.latest = max(self.latest, int(answer.read().decode() or 0))
            except (OSError, ValueError):
                pass  # the launcher is gone or busy: the next poll asks again
            time.sleep(POLL_SECONDS)


_notices: SlotNotices | None = None


def latest_notice() -> int:
    """The latest notice of added slots this process has heard of (rank 0 asks; 0 outside the launcher)."""
    global _notices
    address = os.environ.get(ENV_DRIVER)
    if not address:
        return 0
    if _notices is None:
        _notices = SlotNotices(address, generation())
    return _notices.latest
