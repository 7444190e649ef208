"""benchmarks/studies/slow_links.py: the accuracy part's runs and its report, end to end (the cost part
needs root and a cluster of namespace hosts; its worker is the product's AdasumCallback and
MultiWorkerMirroredStrategy, each tested on its own)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.support.studies import smoke


@pytest.mark.slow
def test_the_accuracy_part_runs_every_method_and_resumes(tmp_path: Path) -> None:
    done = smoke(tmp_path / "out", "slow_links.py", "--parts", "accuracy", "report", "--workloads", "cnn")
    out = tmp_path / "out_smoke"
    with open(out / "accuracy.csv") as f:
        rows = list(csv.DictReader(f))
    # One worker on 2 seeds gives the target; every method at each H on seed 0, the grids' settings
    # each once; the best of each (method, H) again on seed 1.
    methods = {(r["method"], int(r["H"]), int(r["seed"])) for r in rows}
    for method in ("adasum", "adasum_outer", "mean_outer"):
        assert {(method, 4, 0), (method, 4, 1)} <= methods, methods
    assert {("one", 1, 0), ("one", 1, 1), ("mwms", 1, 0), ("mwms", 1, 1)} <= methods
    assert {float(r["inner_lr"]) for r in rows if r["method"] == "mwms" and r["seed"] == "0"} == {1e-3, 2e-3}
    targets = {r["target"] for r in rows if r["method"] != "one"}
    ones = [float(r["final_accuracy"]) for r in rows if r["method"] == "one"]
    assert targets == {str(int(100 * sum(ones) / len(ones)) / 100)}, (targets, ones)
    curves = [json.loads(line) for line in (out / "curves.jsonl").read_text().splitlines()]
    assert len(curves) == len(rows)
    for curve in curves:  # read at every sync, every 8 steps where H < 8, to the budget's end
        assert [step for step, _ in curve["curve"]] == [8, 16], curve
        assert curve["final_accuracy"] == round(curve["curve"][-1][1], 4)
    assert "| Adasum every H + outer | 4 |" in done.stdout

    again = smoke(tmp_path / "out", "slow_links.py", "--parts", "accuracy", "--workloads", "cnn")
    assert '"method"' not in again.stdout  # every run was in the CSV: none ran again

    # The workers part: Adasum alone and the outer grid on 2 replicas, to the same target, the best of
    # each again on seed 1, and the report's table of the best outer step against the workers.
    scaled = smoke(tmp_path / "out", "slow_links.py", "--parts", "workers", "report", "--workloads", "cnn")
    with open(out / "workers.csv") as f:
        runs = list(csv.DictReader(f))
    assert {(r["method"], int(r["H"]), int(r["seed"]), int(r["workers"])) for r in runs} == {
        (method, 4, seed, 2) for method in ("adasum", "adasum_outer") for seed in (0, 1)
    }, runs
    assert {r["target"] for r in runs} == targets
    # Each run on 2 replicas, not on the accuracy part's 4: the same settings and seeds end elsewhere.
    four = {(r["method"], r["seed"], r["outer_lr"], r["outer_momentum"]): r for r in rows if r["H"] == "4"}
    two = [(r, four[(r["method"], r["seed"], r["outer_lr"], r["outer_momentum"])]) for r in runs]
    assert any(a["final_accuracy"] != b["final_accuracy"] for a, b in two), two
    assert "| 2 | 4 |" in scaled.stdout and "| 4 | 4 |" in scaled.stdout, scaled.stdout

    # The inner part: each local method's best setting at twice the one-worker rate, seed 0 then seed 1,
    # to the same target, and the report's table of them beside MWMS.
    tuned = smoke(tmp_path / "out", "slow_links.py", "--parts", "inner", "report", "--workloads", "cnn")
    with open(out / "inner.csv") as f:
        inner = list(csv.DictReader(f))
    assert {(r["method"], int(r["H"]), int(r["seed"])) for r in inner} == {
        (method, 4, seed) for method in ("adasum", "adasum_outer", "mean_outer") for seed in (0, 1)
    }, inner
    assert {float(r["inner_lr"]) for r in inner} == {2e-3} and {r["target"] for r in inner} == targets
    # Each at the rate it says: the same setting and seed at the one-worker rate ends elsewhere.
    ones_rate = {
        (r["method"], r["seed"], r["outer_lr"], r["outer_momentum"]): r
        for r in rows
        if r["H"] == "4" and float(r["inner_lr"]) == 1e-3
    }
    pairs = [(r, ones_rate[(r["method"], r["seed"], r["outer_lr"], r["outer_momentum"])]) for r in inner]
    assert any(a["final_accuracy"] != b["final_accuracy"] for a, b in pairs), pairs
    assert "The local methods at a tuned inner rate, cnn (the one-worker rate 0.001 times 2;" in tuned.stdout
    assert "| Adasum every H + outer | 4 | 0.002 |" in tuned.stdout, tuned.stdout

    # The cores part: the local step in one process alone and in 4 at once, and the report's times
    # composed with a host's cores to itself, from cost rows written here (the cost part needs root and a
    # cluster): each step less the excess of the cluster's "local" step, or without one of the slowest
    # of the 4 at once, over the lone process's.
    smoke(tmp_path / "out", "slow_links.py", "--parts", "cores", "--workloads", "cnn")
    cores = [json.loads(line) for line in (out / "cores.jsonl").read_text().splitlines()]
    assert [(r["workload"], r["processes"], len(r["ms"])) for r in cores] == [("cnn", 1, 1), ("cnn", 4, 4)]
    assert all(ms > 0 for r in cores for ms in r["ms"]), cores
    lone = cores[0]["ms"][0]
    cost = {"rate": "100mbit", "goodput_mbit": 96.0, "workload": "cnn", "round": 0, "bytes": 1e6}
    for local in (None, 50.0):
        excess = local if local is not None else max(cores[1]["ms"]) - lone
        written = [
            {**cost, "method": "mwms", "H": 1, "ms": 300.0 + excess},
            {**cost, "method": "adasum_outer", "H": 4, "ms": 100.0 + excess},
            *([{**cost, "method": "local", "H": 1, "ms": lone + local}] if local is not None else []),
        ]
        (out / "cost.jsonl").write_text("".join(json.dumps(r) + "\n" for r in written))
        report = smoke(tmp_path / "out", "slow_links.py", "--parts", "report", "--workloads", "cnn").stdout
        composed = report[report.index("The local step of cnn with the cores shared (1 rounds)") :]
        assert ("fit with no sync took" in composed.split("\n")[0]) == (local is not None), composed
        table = composed.split("\n\n")[1].splitlines()  # the heading, then the table
        cells = {row[1]: row for row in ([c.strip() for c in line.split("|")] for line in table[2:])}
        mwms, outer = cells["MWMS every step (tuned rate)"], cells["Adasum every H + outer"]
        assert float(mwms[6]) == pytest.approx(300.0, abs=0.06)  # each measured step less the excess
        assert float(outer[6]) == pytest.approx(100.0, abs=0.06)
        ratio = float(outer[3]) * 100.0 / (float(mwms[3]) * 300.0)
        assert float(outer[7].split()[0]) == pytest.approx(ratio, abs=0.006), composed
        assert mwms[7] == "1.00 (1.00-1.00)", composed
