"""The case data that a worker and its test both need: each rank's inputs, the cases a worker runs and the
constants the test rebuilds its oracle from. Tests import these from here, never from a worker.

Sections by worker: multiprocess.py, multiprocess_devices.py, existing_scripts.py (whose shards and
initial weights loops_across_processes.py shares), loops_across_processes.py, horovod_tensorflow.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

# multiprocess.py: the collectives' inputs.

# Every dtype, and tensors that the halving points cut (1031 float64, 33x7 float16, 320 bfloat16).
SHAPES = [
    ((3, 5), "float32"),
    ((0,), "float32"),
    ((1031,), "float64"),
    ((33, 7), "float16"),
    ((7,), "float32"),
    ((320,), "bfloat16"),  # one tensor of its dtype, no pad: read where it is (fusion.fill_or_read_host)
    ((2, 2), "float64"),
]


def rank_tensors(rank: int) -> list[np.ndarray]:
    """Rank `rank`'s tensors of SHAPES; the test builds the oracle from every rank's."""
    rng = np.random.default_rng(100 + rank)
    return [
        (rng.standard_normal(shape) * (rank + 1)).astype(tf.as_dtype(dtype).as_numpy_dtype)
        for shape, dtype in SHAPES
    ]


# Exchanges of at least 2 MiB go in lanes under the TF engine (TFCollectiveCommunicator.LANES): a float32
# tensor of 3 MiB and a word, and a bfloat16 one whose parts split unevenly.
LANE_SHAPES = [((786433,), "float32"), ((1200007,), "bfloat16")]


def lane_tensors(rank: int) -> list[np.ndarray]:
    """Rank `rank`'s tensors of LANE_SHAPES."""
    rng = np.random.default_rng(200 + rank)
    return [
        (rng.standard_normal(s) * (rank + 1)).astype(tf.as_dtype(d).as_numpy_dtype) for s, d in LANE_SHAPES
    ]


# VHDD as a pipeline of chunks (vhdd.pipelined_tensors), with chunks of 64 KiB and up in the worker: 2.6 MB
# of float32 in 9 tensors of uneven sizes (7 chunks) and 0.3 MB of bfloat16 in 3 (a second buffer, 3).
PIPELINE_SHAPES = [
    ((n,), "float32") for n in (70001, 40000, 99991, 3, 120000, 65537, 80000, 33333, 140000)
] + [((n,), "bfloat16") for n in (50001, 40000, 60000)]
PIPELINE_BYTES = 64 << 10
# One tensor of 12 PIPELINE_BYTES: its gather goes in 8 parts (PIPELINE_CHUNKS) where it has two levels.
PIPELINE_ONE = 196613


def pipeline_one(rank: int) -> np.ndarray:
    """Rank `rank`'s one tensor of PIPELINE_ONE float32s."""
    return (np.random.default_rng(400 + rank).standard_normal(PIPELINE_ONE) * (rank + 1)).astype(np.float32)


def pipeline_tensors(rank: int) -> list[np.ndarray]:
    """Rank `rank`'s tensors of PIPELINE_SHAPES."""
    rng = np.random.default_rng(300 + rank)
    return [
        (rng.standard_normal(s) * (rank + 1)).astype(tf.as_dtype(d).as_numpy_dtype)
        for s, d in PIPELINE_SHAPES
    ]


def local_counts(case: str, size: int) -> list[int]:
    """How many replicas each process holds in the allreduce_replicas checks."""
    return {"two": [2] * size, "three": [3] * size, "uneven": [1 + q % 3 for q in range(size)]}[case]


def replica_tensors(case: str, size: int, rank: int) -> list[list[np.ndarray]]:
    """This process's replicas: leaf j of the tree over all of them holds rank_tensors(j)."""
    counts = local_counts(case, size)
    first = sum(counts[:rank])
    return [rank_tensors(first + j) for j in range(counts[rank])]


def saved(t: Any) -> np.ndarray:
    """A result as npz can hold it: 16-bit floats widened to float32 (exactly)."""
    return t.numpy().astype(np.float32) if t.dtype.size == 2 else t.numpy()


# multiprocess.py's writes mode: (how, optimizer, sync_every) for test_training.fit_write_fit on one
# replica in each of two processes.
PROCESS_WRITES = (("set_weights", "adam", 2), ("early_stopping", "sgd_momentum", 1))


# multiprocess_devices.py: (optimizer, sync_every, local_reduction); each replica takes LOCAL rows of every
# global batch, for STEPS steps.
DEVICE_CASES = (("sgd_momentum", 1, "adasum"), ("adam", 2, "adasum"), ("adam", 1, "mean"))
LOCAL, STEPS = 2, 4
# Resumed from each process's own checkpoint after STEPS // 2 steps (a sync), then the rest: as
# DEVICE_CASES' run of the same case, bitwise, every replica's optimizer state included.
RESUMED = (("adam", 2, "adasum"), ("adam", 1, "mean"))
# The environment variable that gives multiprocess_devices.py each rank's number of replicas ("2,3").
REPLICA_COUNTS = "TF_ADASUM_TEST_REPLICA_COUNTS"


# existing_scripts.py (and loops_across_processes.py): each rank's shard of a linear problem.

ROWS_PER_RANK, BATCH, FEATURES, OUTPUTS = 16, 4, 3, 2
# The callback mode's cases: kind, sync_every, root (modulo the number of processes), steps_per_execution.
CASES = [
    ("sgd_momentum", 1, 0, 1),
    ("adam", 1, 1, 1),
    ("sgd_momentum", 2, 2, 1),
    ("adam", 2, 0, 1),
    ("sgd_momentum", 1, 1, 2),  # two steps per compiled call: still a sync after every step
]
# The accumulate mode's cases: (op, optimizer, backward_passes_per_step, average_aggregated_gradients),
# under tf_adasum.keras.
ACCUMULATION = {
    "accumulate_average": ("Average", "adam", 2, True),
    "accumulate_sum": ("Sum", "sgd_momentum", 4, False),
}


def shard(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + rank)
    x = rng.standard_normal((ROWS_PER_RANK, FEATURES)).astype(np.float32)
    y = rng.standard_normal((ROWS_PER_RANK, OUTPUTS)).astype(np.float32)
    return x, y


def initial_weights(rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng(2000 + rank)
    return [
        rng.standard_normal((FEATURES, OUTPUTS)).astype(np.float32),
        rng.standard_normal(OUTPUTS).astype(np.float32),
    ]


# loops_across_processes.py's ordering mode: fresh functions that trace and run anew, in each of its two
# loops. Out of order, the MPI engine's collectives failed in about one run of three (MPI_ERR_TRUNCATE);
# ten catch that in 98% of launches.
REPETITIONS = 10


# horovod_tensorflow.py: each rank's inputs.


def reduced_inputs(rank: int) -> dict[str, np.ndarray]:
    """Each rank's inputs of the Min, Max and Product all-reduces: mixed signs, several dtypes."""
    rng = np.random.default_rng(100 + rank)
    return {
        "float32": rng.standard_normal((3, 4)).astype(np.float32),
        "float64": rng.standard_normal(5) * 10.0 ** rng.integers(-30, 30, 5),
        "float16": rng.standard_normal(6).astype(np.float16),
        "int32": rng.integers(-50, 50, (2, 3)).astype(np.int32),
        "int8": rng.integers(-5, 5, 7).astype(np.int8),
        "uint64": np.array([2**63 + rank, 2**64 - 1 - 7 * rank, rank], np.uint64),
    }


def alltoall_input(rank: int, p: int) -> tuple[np.ndarray, list[int]]:
    """Rank r's rows (2p + r of them, each naming its rank and row) and its splits: (r + d) % 2 + 1 rows
    to rank d, so that rank r > 0 keeps rows it sends to nobody."""
    rows = 2 * p + rank
    tensor = np.stack([np.full(rows, rank), np.arange(rows)], axis=1).astype(np.float32) + 0.5
    return tensor, [(rank + d) % 2 + 1 for d in range(p)]


def allgather_inputs(rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank r's grouped_allgather tensors: r + 1 rows of floats, and 1 - r % 2 rows of int64 (none on
    odd ranks)."""
    a = np.arange((rank + 1) * 2, dtype=np.float32).reshape(rank + 1, 2) - 10.0 * rank
    b = np.full((1 - rank % 2, 3), rank, np.int64)
    return a, b


def scatter_inputs(rank: int) -> tuple[np.ndarray, np.ndarray]:
    return (
        np.arange(10, dtype=np.float32).reshape(5, 2) * (rank + 1) - 3.0,
        np.arange(3, dtype=np.float64) + rank,
    )


def batch(rank: int) -> np.ndarray:
    """Rank r's SyncBatchNormalization batch: 3 + r rows of 3 channels, far from zero mean."""
    rng = np.random.default_rng(300 + rank)
    return (rng.standard_normal((3 + rank, 3)) * [1.0, 5.0, 0.1] + [4.0, -2.0, 100.0]).astype(np.float32)


# optimizer_options.py (and tests/test_optimizer_options.py in one process): each Keras optimizer option,
# a case each. Replica (or process) r takes rows (s * p + r) * OPTION_LOCAL, ... of
# tests/support/training.py's problem at step s of each epoch.

OPTION_LR, OPTION_SECOND_LR, OPTION_EMA_MOMENTUM = 0.1, 0.05, 0.5
OPTION_LOCAL, OPTION_STEPS, OPTION_EPOCHS = (
    4,
    2,
    2,
)  # rows a replica takes a step; steps an epoch; epochs a fit


@dataclass(frozen=True)
class Case:
    """One option (or two together) and how a fit sets it up."""

    sgd: dict[str, Any] = field(default_factory=dict)  # keras.optimizers.SGD's options
    schedule: bool = False  # learning_rate=ExponentialDecay(OPTION_LR, 2, 0.5)
    exclude: tuple[str, ...] = ()  # exclude_from_weight_decay(var_names=...)
    sync_every: int = 1
    loss_scale: bool = False  # a LossScaleOptimizer around the optimizer that syncs
    two_optimizers: bool = False  # a train_step that steps the bias with a second SGD(OPTION_SECOND_LR)
    swap: bool = False  # SwapEMAWeights, with validation at each epoch's end
    under_a_strategy: bool = True  # AdasumStrategy runs it; False: refuses it at compile

    @property
    def accumulation(self) -> int:
        return int(self.sgd.get("gradient_accumulation_steps") or 1)

    @property
    def ema(self) -> bool:
        return bool(self.sgd.get("use_ema"))


EMA_OPTIONS = {"use_ema": True, "ema_momentum": OPTION_EMA_MOMENTUM}
OPTION_CASES = {
    "clipnorm": Case({"clipnorm": 0.05}),
    "clipvalue": Case({"clipvalue": 0.02}),
    "global_clipnorm": Case({"global_clipnorm": 0.05}),
    "weight_decay": Case({"weight_decay": 0.5}, exclude=("bias",)),
    "schedule": Case(schedule=True),
    "loss_scale": Case(loss_scale=True),
    "two_optimizers": Case(two_optimizers=True),
    "ema": Case(EMA_OPTIONS, swap=True),
    "ema_loss_scale": Case(EMA_OPTIONS, loss_scale=True, swap=True),
    "ema_overwrite": Case({**EMA_OPTIONS, "ema_overwrite_frequency": 2}, under_a_strategy=False),
    "accumulation": Case({"gradient_accumulation_steps": 2}, under_a_strategy=False),
    "accumulation_sync_every_2": Case(
        {"gradient_accumulation_steps": 2}, sync_every=2, under_a_strategy=False
    ),
    "ema_accumulation": Case(
        {**EMA_OPTIONS, "gradient_accumulation_steps": 2}, swap=True, under_a_strategy=False
    ),
}
