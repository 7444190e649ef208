"""The slots an elastic job may use: the host discovery script's latest good answer (Horovod's
--host-discovery-script, run every --host-discovery-interval seconds, 1 s as Horovod's), or -H's, or N on
this host.

The script runs in a thread of its own, as Horovod's does, so that a slow or hanging script never
holds the launcher's loop (its deadlines, its watch on the processes). A run that fails, prints a line
that is not `host:slots`, or outlasts SCRIPT_TIMEOUT_SECONDS (its whole process group is then killed)
leaves the last good answer in place, and is said once for each new problem.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from tf_adasum.launch.elastic.policy import parse_slots

# Horovod's period. A growth waits half of it on average before the launcher sees the new slots.
DEFAULT_INTERVAL_SECONDS = 1.0
# How long one run of the script may take.
SCRIPT_TIMEOUT_SECONDS = 30.0


class Discovery:
    """The slots the job may use: the discovery script's latest good answer, or -H's; `interval`: the
    seconds between two runs of the script. start() starts the script's thread, close() ends it."""

    def __init__(
        self,
        script: str | None,
        hosts: str | None,
        np: int,
        interval: float = DEFAULT_INTERVAL_SECONDS,
        timeout: float = SCRIPT_TIMEOUT_SECONDS,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"expected a --host-discovery-interval above 0 seconds, got {interval}")
        self.script, self.interval, self.timeout = script, interval, timeout
        self.static = parse_slots(hosts.replace(",", "\n")) if hosts else {"127.0.0.1": np}
        self.problem: str | None = None
        self._answer: dict[str, int] | None = None
        self._answered = threading.Event()
        self._closed = threading.Event()
        self._running: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        if self.script:
            threading.Thread(target=self._loop, daemon=True, name="tf_adasum-discovery").start()

    def slots(self) -> dict[str, int]:
        """The latest good answer ({} before the first)."""
        if not self.script:
            return dict(self.static)
        return dict(self._answer or {})

    def first_answer(self, wait: float) -> dict[str, int]:
        """The first good answer, waiting at most `wait` seconds for it ({} if none came)."""
        if self.script:
            self._answered.wait(wait)
        return self.slots()

    def close(self) -> None:
        """Stops the runs, and kills a run under way."""
        self._closed.set()
        with self._lock:
            running = self._running
        if running is not None:
            _kill_group(running)

    def _loop(self) -> None:
        while not self._closed.is_set():
            started = time.monotonic()
            try:
                answer = self._run()
            except ValueError as error:
                self._say(str(error))
            else:
                self.problem = None
                self._answer = answer
                self._answered.set()
            self._closed.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def _run(self) -> dict[str, int]:
        assert self.script is not None
        process = subprocess.Popen(
            self.script,
            shell=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: a timeout kills whatever it started
        )
        with self._lock:
            self._running = process
        try:
            out, err = process.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            process.communicate()
            raise ValueError(
                f"ran past its {self.timeout:.0f} s timeout and was killed, with what it started"
            ) from None
        finally:
            with self._lock:
                self._running = None
        if process.returncode != 0:
            raise ValueError(f"exited with {process.returncode}: {err.strip()[-300:]}")
        return parse_slots(out)

    def _say(self, problem: str) -> None:
        if self.problem != problem and not self._closed.is_set():
            kept = "keeping its last good answer" if self._answer is not None else "no answer yet"
            sys.stderr.write(f"tf_adasum.run: host discovery script {self.script!r}: {problem} ({kept})\n")
            sys.stderr.flush()
        self.problem = problem


def _kill_group(process: subprocess.Popen[str]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
