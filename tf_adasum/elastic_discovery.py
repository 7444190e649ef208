"""The slots an elastic job may use: the host discovery script's latest answer (Horovod's
--host-discovery-script, run by the launcher every --host-discovery-interval seconds, 1 s as Horovod's),
or -H's, or N on this host."""

from __future__ import annotations

import subprocess
import sys

from tf_adasum.elastic_policy import parse_slots

# Horovod's period. A growth waits half of it on average before the launcher sees the new slots.
DEFAULT_INTERVAL_SECONDS = 1.0


class Discovery:
    """The slots the job may use: the discovery script's latest answer, or -H's; `interval`: the seconds
    between two runs of the script."""

    def __init__(
        self, script: str | None, hosts: str | None, np: int, interval: float = DEFAULT_INTERVAL_SECONDS
    ) -> None:
        if not interval > 0:
            raise ValueError(f"expected a --host-discovery-interval above 0 seconds, got {interval}")
        self.script, self.interval = script, interval
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
