"""The studies' smoke runs (benchmarks/studies/convergence.py, staleness.py), as the tests run them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUDIES = ROOT / "benchmarks" / "studies"  # convergence.py, staleness.py, elastic.py, ...


def smoke(out: Path, script: str = "convergence.py", *flags: str) -> subprocess.CompletedProcess[str]:
    """Runs benchmarks/studies/`script` --smoke, writing under `out`; checks that it succeeded."""
    command = [sys.executable, str(STUDIES / script), "--smoke", "--out", str(out), *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done
