"""Single-worker local steps across processes (tests/workers/loss_scaling.py): 2 processes under mpirun,
one replica each, AdasumStrategy; the weights after one SGD step against numpy's tree of each process's
single-worker step on its share of the global batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.support import processes
from tests.support.loss_scaling import assert_weights, data, expected


@pytest.mark.multiprocess
def test_two_processes_step_single_workers_whatever_the_loss(tmp_path: Path) -> None:
    modes = ["hand_built", "mixed", "average_loss"]
    code = processes.launch(
        "mpi", 2, tmp_path, ["-m", "tests.workers.loss_scaling", str(tmp_path), ",".join(modes)]
    )
    assert code == 0, processes.log_tail(tmp_path)
    x, y, w, b = data(2)
    for mode in modes:
        want = expected(2, w, b, x, y, regularized=mode == "mixed")
        got = [np.load(tmp_path / f"{mode}{rank}.npz") for rank in range(2)]
        for rank in range(2):
            assert_weights([got[rank]["arr_0"], got[rank]["arr_1"]], want)
