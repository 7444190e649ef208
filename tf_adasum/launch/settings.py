"""A launch's options as one object (Horovod's runner/elastic/settings.py): LaunchSettings for every
launch, ElasticSettings for `--elastic`, each refusing on construction what no job can keep. No
TensorFlow here."""

from __future__ import annotations

from dataclasses import dataclass, field

from tf_adasum.launch.elastic.discovery import DEFAULT_INTERVAL_SECONDS
from tf_adasum.launch.hosts import DEFAULT_AGENT


def _above(flag: str, value: float | None, least: float) -> None:
    if value is not None and not value > least:
        raise ValueError(f"expected {flag} above {least:g}, got {value}")


@dataclass(frozen=True)
class LaunchSettings:
    """What `python -m tf_adasum.run` launches, and how.

    Attributes:
        np: how many processes (the first group's size, elastic).
        command: what each process runs (`python script args`, or `python -m module args`).
        hosts: horovodrun's `-H host:slots,...`; default all on 127.0.0.1.
        agent: how a process starts on a host that is not this one (`AGENT HOST COMMAND`).
        timeout: seconds after which every process is killed (exit code 124).
        output_filename: a folder for every rank's stdout and stderr (launch/output.py).

    Raises:
        ValueError: np below 1, or a timeout that is not above 0.
    """

    np: int
    command: list[str] = field(default_factory=list)
    hosts: str | None = None
    agent: str = DEFAULT_AGENT
    timeout: float | None = None
    output_filename: str | None = None

    def __post_init__(self) -> None:
        if self.np < 1:
            raise ValueError(f"expected -np 1 or more, got {self.np}")
        _above("--timeout", self.timeout, 0)


@dataclass(frozen=True)
class ElasticSettings(LaunchSettings):
    """An elastic launch (launch/elastic/driver.py): LaunchSettings, and

    Attributes:
        min_np: the fewest workers the job goes on with (default np).
        max_np: the most workers (default np).
        discovery_script: prints the available host:slots lines; run every `discovery_interval` seconds.
        discovery_interval: the seconds between two runs of the discovery script (1, as Horovod's).
        reset_limit: how many resets (new groups after the first) the job may take; None: any number.
        elastic_timeout: how long to wait for min_np slots before giving up.
        state_dir: where processes write their commits when they leave a group (on their own host); the
            launcher keeps a copy of every commit in STATE_DIR/job/group<g>. Default: a new private
            folder.
        resume_from: an earlier job's STATE_DIR/job/group<g>: the first group resumes from its commits.
        standbys: warm processes kept waiting on each host (launch/elastic/pool.py); None: as many as
            the host has slots, up to max_np; 0: every process starts cold.

    Raises:
        ValueError: sizes no job can keep: not 1 <= min_np <= np <= max_np, a timeout not above 0, a
            negative reset limit or number of standbys, or both -H and a discovery script.
    """

    min_np: int | None = None
    max_np: int | None = None
    discovery_script: str | None = None
    discovery_interval: float = DEFAULT_INTERVAL_SECONDS
    reset_limit: int | None = None
    elastic_timeout: float = 600.0
    state_dir: str | None = None
    resume_from: str | None = None
    standbys: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.fewest <= self.np <= self.most:
            raise ValueError(
                f"expected 1 <= --min-np <= -np <= --max-np, got {self.fewest}, {self.np}, {self.most}"
            )
        _above("--elastic-timeout", self.elastic_timeout, 0)
        _above("--host-discovery-interval", self.discovery_interval, 0)
        _above("--reset-limit", self.reset_limit, -1)
        _above("--standbys", self.standbys, -1)
        if self.hosts and self.discovery_script:
            raise ValueError("give -H or --host-discovery-script, not both")

    @property
    def fewest(self) -> int:
        """min_np, or np."""
        return self.np if self.min_np is None else self.min_np

    @property
    def most(self) -> int:
        """max_np, or np."""
        return self.np if self.max_np is None else self.max_np

    @property
    def per_host_standbys(self) -> int:
        return self.most if self.standbys is None else self.standbys
