"""tf_adasum.tensorflow's names beyond the tape loop: alltoall, the grouped and in-place collectives, the
object collectives, Min/Max/Product, PartialDistributedGradientTape, SyncBatchNormalization and the
queries; in a world of one here (eagerly and in tf.function), and on two real processes under each engine
(tests/workers/horovod_tensorflow.py), against numpy."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adasum.keras
import tf_adasum.tensorflow as hvd
from tests.support import processes
from tests.support.processes import log_tail
from tests.workers.data import allgather_inputs, alltoall_input, batch, reduced_inputs, scatter_inputs

WORKER = ["-m", "tests.workers.horovod_tensorflow"]
MODES = ("engine", "collectives", "objects", "sync_batch_norm", "partial_tape", "bad_input")

# horovod.tensorflow 0.28.1's public names: dir() of the module, less the modules it imports but elastic,
# and less its internal helpers (check_extension, check_num_rank_power_of_2, split_list, vars_to_refs,
# handle_average_backwards_compatibility, LocalGradientAggregationHelper, refs_to_vars); plus
# BroadcastGlobalVariablesHook, which it defines where TensorFlow 1's SessionRunHook exists.
HOROVOD_TENSORFLOW_NAMES = (
    "Adasum Average BroadcastGlobalVariablesHook Compression DistributedGradientTape DistributedOptimizer "
    "Max Min PartialDistributedGradientTape ProcessSet Product Sum SyncBatchNormalization add_process_set "
    "allgather allgather_object allreduce alltoall broadcast broadcast_ broadcast_global_variables "
    "broadcast_object broadcast_object_fn broadcast_variables ccl_built cross_rank cross_size cuda_built "
    "ddl_built elastic global_process_set gloo_built gloo_enabled gpu_available grouped_allgather "
    "grouped_allreduce grouped_reducescatter init is_homogeneous is_initialized join local_rank "
    "local_rank_op local_size local_size_op mpi_built mpi_enabled mpi_threads_supported nccl_built "
    "process_set_included_op rank rank_op reducescatter remove_process_set rocm_built shutdown size size_op "
    "start_timeline stop_timeline"
).split()


def test_every_name_of_horovods_tensorflow_module_exists() -> None:
    assert len(HOROVOD_TENSORFLOW_NAMES) == 60
    assert set(HOROVOD_TENSORFLOW_NAMES) <= set(hvd.__all__)
    assert [n for n in HOROVOD_TENSORFLOW_NAMES if not hasattr(hvd, n)] == []
    # horovod.tensorflow.keras has none of the new names but broadcast_global_variables: the same one.
    assert tf_adasum.keras.broadcast_global_variables is hvd.broadcast_global_variables


@pytest.mark.parametrize("op", ["Min", "Max", "Product"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "int32", "int8"])
def test_min_max_product_in_a_world_of_one(op: str, dtype: str, run: Callable[..., Any]) -> None:
    x = tf.constant(np.array([[3, -2, 0], [1, 5, -4]]), dtype)
    got = run(lambda t: hvd.allreduce(t, op=getattr(hvd, op), prescale_factor=2.0), x)
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(got.numpy(), x.numpy() * 2)
    grouped = run(lambda t: hvd.grouped_allreduce([t, t[0]], op=getattr(hvd, op)), x)
    np.testing.assert_array_equal(grouped[1].numpy(), x.numpy()[0])
    assert hvd.Min is tf_adasum.distributed.Min and hvd.Product.value == "product"


def test_reducescatter_takes_only_sum_and_average(run: Callable[..., Any]) -> None:
    for op in (hvd.Min, hvd.Max, hvd.Product, hvd.Adasum):
        with pytest.raises(
            NotImplementedError, match=rf"reducescatter\(op={op.name.title()}\) is not supported"
        ):
            hvd.grouped_reducescatter([tf.ones(4)], op=op)
    with pytest.raises(ValueError, match="tensor 1 of 2 is a scalar"):
        hvd.grouped_reducescatter([tf.ones(4), tf.ones([])])
    got = run(lambda a, b: hvd.grouped_reducescatter([a, b], op=hvd.Sum), tf.ones([3, 2]), tf.range(4))
    np.testing.assert_array_equal(got[0].numpy(), np.ones((3, 2)))
    np.testing.assert_array_equal(got[1].numpy(), np.arange(4))
    assert hvd.grouped_reducescatter([]) == []


def test_alltoall_in_a_world_of_one(run: Callable[..., Any]) -> None:
    x = tf.reshape(tf.range(12.0), [4, 3])
    np.testing.assert_array_equal(run(lambda t: hvd.alltoall(t), x).numpy(), x.numpy())
    received, counts = run(lambda t: hvd.alltoall(t, splits=[3]), x)
    # Rows past the splits' sum are not sent, as in Horovod; received_splits are int32.
    np.testing.assert_array_equal(received.numpy(), x.numpy()[:3])
    assert counts.dtype == tf.int32 and counts.numpy().tolist() == [3]
    received, _ = run(lambda t: hvd.alltoall(t, splits=tf.constant([0], tf.int64)), x)
    assert received.shape == (0, 3)


def test_alltoall_refuses_bad_input_saying_what_it_expected() -> None:
    x = tf.ones([4, 3])
    with pytest.raises(ValueError, match=r"rank 0's splits \[5\] add up to 5 rows, more than its tensor's 4"):
        hvd.alltoall(x, splits=[5])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"splits \[-1\] hold a negative count"):
        tf.function(lambda t: hvd.alltoall(t, splits=[-1]))(x)
    with pytest.raises(ValueError, match=r"splits has shape \(2,\); expected \[1\], one count per process"):
        hvd.alltoall(x, splits=[1, 1])
    with pytest.raises(ValueError, match="splits has dtype float32; expected integers"):
        hvd.alltoall(x, splits=[1.0])
    with pytest.raises(ValueError, match="the tensor is a scalar; alltoall needs tensors of rank 1 or more"):
        hvd.alltoall(1.0)
    with pytest.raises(NotImplementedError, match=r"alltoall\(process_set=1\)"):
        hvd.alltoall(x, process_set=1)


def test_grouped_allgather_in_a_world_of_one(run: Callable[..., Any]) -> None:
    a, b = tf.ones([2, 3]), tf.zeros([0, 1], tf.int64)
    got = run(lambda x, y: hvd.grouped_allgather([x, y]), a, b)
    assert [g.shape for g in got] == [(2, 3), (0, 1)] and got[1].dtype == tf.int64
    assert hvd.grouped_allgather([]) == []
    with pytest.raises(
        ValueError, match="tensor 1 of 2 is a scalar; grouped_allgather needs tensors of rank 1"
    ):
        hvd.grouped_allgather([a, 1.0])
    with pytest.raises(ValueError, match="the tensor is a scalar; allgather needs tensors of rank 1 or more"):
        hvd.allgather(1.0)


def test_broadcast_in_place_assigns_and_returns_the_values(run: Callable[..., Any]) -> None:
    variable, keras_variable = tf.Variable([1.0, 2.0]), keras.Variable(np.ones((2, 2)), dtype="float64")
    got = run(lambda: hvd.broadcast_([variable, keras_variable], root_rank=0))
    assert [g.dtype for g in got] == [tf.float32, tf.float64]
    np.testing.assert_array_equal(got[0].numpy(), [1.0, 2.0])
    assert run(lambda: hvd.broadcast_([], 0)) == []
    with pytest.raises(TypeError, match="takes variables, but tensor 1 of 2 is a EagerTensor"):
        hvd.broadcast_([variable, tf.ones(2)], root_rank=0)
    with pytest.raises(ValueError, match="root rank 1 is not a rank of this job of 1 processes"):
        hvd.broadcast_([variable], root_rank=1)


def test_the_object_collectives_are_eager_only_as_in_horovod() -> None:
    obj = {"a": [1, 2], "b": np.arange(3)}
    assert hvd.broadcast_object(obj) is obj
    (copy,) = hvd.allgather_object(obj)
    assert copy is not obj and copy["a"] == [1, 2] and copy["b"].tolist() == [0, 1, 2]
    assert hvd.broadcast_object_fn(root_rank=0)(obj) is obj
    for call in (lambda: hvd.broadcast_object(1), lambda: hvd.allgather_object(1)):
        with pytest.raises(RuntimeError, match=r"runs eagerly only .* call it outside tf.function"):
            tf.function(call)()
    with pytest.raises(ValueError, match="broadcast_object: root_rank 2 is not a rank of this job of 1"):
        hvd.broadcast_object(obj, root_rank=2)
    with pytest.raises(NotImplementedError, match=r"broadcast_object_fn\(session="):
        hvd.broadcast_object_fn(session=object())
    with pytest.raises(TypeError, match=r"allgather_object: objects that cannot be pickled \(rank 0: "):
        hvd.allgather_object(lambda: 1)


def test_the_queries_and_the_op_functions(run: Callable[..., Any]) -> None:
    ids = run(lambda: [hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op()])
    assert [(int(i), i.dtype, i.shape) for i in ids] == [(v, tf.int32, ()) for v in (0, 1, 0, 1)]
    included = run(lambda: hvd.process_set_included_op())
    assert int(included) == 1 and included.dtype == tf.int32
    with pytest.raises(NotImplementedError, match=r"size_op\(process_set_id=1\)"):
        hvd.size_op(process_set_id=1)
    assert hvd.is_homogeneous() is True
    assert hvd.gpu_available("torch") is False
    assert hvd.gpu_available("tensorflow") is bool(tf.config.list_physical_devices("GPU"))


def test_the_tensorflow_1_session_apis_name_the_tensorflow_2_way() -> None:
    with pytest.raises(NotImplementedError, match=r"hvd.broadcast_variables\(model.variables, root_rank=1\)"):
        hvd.broadcast_global_variables(1)
    with pytest.raises(NotImplementedError, match=r"SessionRunHook.*broadcast_variables\(model.variables"):
        hvd.BroadcastGlobalVariablesHook(0)


def test_sync_batch_normalization_in_a_world_of_one_is_batch_normalization(run: Callable[..., Any]) -> None:
    x = tf.constant(batch(1))
    sync, plain = hvd.SyncBatchNormalization(momentum=0.5), keras.layers.BatchNormalization(momentum=0.5)
    assert sync.name == "sync_batch_normalization"
    np.testing.assert_allclose(run(lambda t: sync(t, training=True), x), plain(x, training=True), atol=1e-6)
    np.testing.assert_allclose(sync.moving_variance.numpy(), plain.moving_variance.numpy(), rtol=1e-6)
    with pytest.raises(ValueError, match="does not support fused=True"):
        hvd.SyncBatchNormalization(fused=True)
    restored = hvd.SyncBatchNormalization.from_config(sync.get_config())
    assert isinstance(restored, hvd.SyncBatchNormalization) and restored.momentum == 0.5
    assert (
        keras.saving.get_registered_object("tf_adasum>SyncBatchNormalization") is hvd.SyncBatchNormalization
    )


def test_partial_tape_keeps_the_local_layers_gradients(run: Callable[..., Any]) -> None:
    shared, local = keras.layers.Dense(2), keras.layers.Dense(1)
    model = keras.Sequential([keras.Input((3,)), shared, local])
    x = tf.constant(np.arange(6.0).reshape(2, 3), tf.float32)

    def gradients() -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        plain = tape.gradient(loss, model.trainable_variables)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        partial = hvd.PartialDistributedGradientTape(tape, local_layers=local, scale_local_gradients=False)
        return plain, partial.gradient(loss, model.trainable_variables)

    plain, reduced = run(gradients)
    for got, want in zip(reduced, plain, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x) ** 2)
    partial = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
    mine, others = partial.get_local_and_global_gradients(loss, model.trainable_variables)
    assert [v.path for v, _ in mine] == [v.path for v in local.trainable_weights]
    assert [v.path for v, _ in others] == [v.path for v in shared.trainable_weights]
    with pytest.raises(ValueError, match=r"local_layers\[1\] is a str; every local layer must be a keras"):
        hvd.PartialDistributedGradientTape(tape, local_layers=[local, "dense"])


def load_results(out: Path, p: int) -> list[dict[str, Any]]:
    """Each rank's results, one entry per mode (the worker writes each mode's to its own file)."""
    return [{m: json.loads((out / f"{m}{r}.json").read_text()) for m in MODES} for r in range(p)]


def my_rows(total: np.ndarray, r: int, p: int) -> np.ndarray:
    n = total.shape[0]
    start = r * (n // p) + min(r, n % p)
    return total[start : start + n // p + (r < n % p)]


def check_collectives(results: list[dict[str, Any]], p: int) -> None:
    inputs = [reduced_inputs(r) for r in range(p)]
    tensors = [alltoall_input(r, p) for r in range(p)]
    gathered_inputs = [allgather_inputs(r) for r in range(p)]
    scattered = [scatter_inputs(r) for r in range(p)]
    for r, result in enumerate(results):
        seen = result["collectives"]
        for how in ("eager", "compiled"):
            for op, reduce in (("Min", np.minimum.reduce), ("Max", np.maximum.reduce), ("Product", np.prod)):
                for name, got in seen[f"{how}_{op}"].items():
                    stacked = np.stack([i[name] for i in inputs])
                    want = reduce(stacked, axis=0, dtype=stacked.dtype)
                    if name == "uint64":  # JSON's exact integers: above 2**63 too
                        assert got == [int(v) for v in want], (how, op, got)
                    else:
                        np.testing.assert_array_equal(
                            np.asarray(got, stacked.dtype), want, err_msg=f"{how} {op} {name}"
                        )
            grouped = seen[f"{how}_grouped_max"]
            for got, name in zip(grouped, ("float32", "int32"), strict=True):
                np.testing.assert_array_equal(got, np.maximum.reduce([i[name] for i in inputs]))
            # alltoall: from each rank s the splits_s[r] rows after those s sends to lower ranks.
            want = np.concatenate([t[sum(splits[:r]) : sum(splits[:r]) + splits[r]] for t, splits in tensors])
            got = seen[f"{how}_alltoall"]
            np.testing.assert_array_equal(np.asarray(got["received"]).reshape(-1, 2), want, err_msg=how)
            assert got["splits"] == [splits[r] for _, splits in tensors] and got["dtype"] == "int32"
            even = np.concatenate([t[2 * r : 2 * r + 2] for t, _ in tensors])
            np.testing.assert_array_equal(seen[f"{how}_alltoall_even"], even, err_msg=how)
            a, b = seen[f"{how}_grouped_allgather"]
            np.testing.assert_array_equal(a, np.concatenate([x for x, _ in gathered_inputs]))
            np.testing.assert_array_equal(
                np.asarray(b).reshape(-1, 3), np.concatenate([y for _, y in gathered_inputs])
            )
            total_f, total_g = sum(f for f, _ in scattered), sum(g for _, g in scattered)
            rs = seen[f"{how}_grouped_reducescatter"]
            np.testing.assert_allclose(rs["sum"][0], my_rows(total_f, r, p), rtol=1e-6)
            np.testing.assert_allclose(rs["sum"][1], my_rows(total_g, r, p), rtol=1e-12)
            np.testing.assert_allclose(rs["average"][0], my_rows(total_f / p, r, p), rtol=1e-6)
            root = p - 1
            broadcast = seen[f"{how}_broadcast_"]
            for values in (broadcast["returned"], broadcast["variables"]):
                assert values == [[float(root)] * 3, [[10.0 * root] * 2] * 2], (how, r, values)
            assert seen[f"{how}_ids"] == [r, p, r, p] and seen[f"{how}_included"] == 1


def check_objects(results: list[dict[str, Any]], p: int) -> None:
    for r, result in enumerate(results):
        seen = result["objects"]
        assert seen["broadcast"] == {"rank": p - 1, "rows": list(range(p)), "text": "é" * (p - 1)}
        assert seen["broadcast_is_own"] is (r == p - 1)
        assert seen["allgather"] == [[s, [s] * s] for s in range(p)]
        assert seen["broadcast_fn"] == "from rank 0" and seen["homogeneous"] is True


def check_sync_batch_norm(results: list[dict[str, Any]], p: int) -> None:
    everything = np.concatenate([batch(r) for r in range(p)]).astype(np.float64)
    mean, variance = everything.mean(axis=0), everything.var(axis=0)
    for r, result in enumerate(results):
        seen = result["sync_batch_norm"]
        oracle = seen["oracle"]
        # The numpy statistics of the global batch, and Keras's layer run on all of it.
        np.testing.assert_allclose(oracle["moving_mean"], 0.5 * mean, rtol=1e-5)
        for how in ("eager", "compiled"):
            got = seen[how]
            assert got["name"] == "sync_batch_normalization"
            np.testing.assert_allclose(got["moving_mean"], 0.5 * mean, rtol=1e-5, err_msg=how)
            np.testing.assert_allclose(got["moving_variance"], 0.5 + 0.5 * variance, rtol=1e-5, err_msg=how)
            # float32 inputs near 100 with a spread of 0.1 (channel 2) normalise to about 1e-4.
            normalised = (batch(r) - mean) / np.sqrt(variance + 1e-3)
            np.testing.assert_allclose(got["output"], normalised, atol=2e-4, err_msg=how)
            np.testing.assert_allclose(got["output"], oracle["output"], atol=2e-4, err_msg=how)
            np.testing.assert_allclose(got["dx"], oracle["dx"], rtol=1e-3, atol=1e-4, err_msg=how)
    for how in ("eager", "compiled"):  # each rank's gamma gradient is its rows' share of the global one
        total = np.sum([result["sync_batch_norm"][how]["dgamma"] for result in results], axis=0)
        np.testing.assert_allclose(
            total, results[0]["sync_batch_norm"]["oracle"]["dgamma"], rtol=1e-4, atol=1e-4
        )


def check_partial_tape(results: list[dict[str, Any]], p: int) -> None:
    for how in ("eager", "compiled"):
        for scale in (True, False):
            plain = [
                [np.asarray(g) for g in result["partial_tape"][f"{how}_{scale}"]["plain"]]
                for result in results
            ]
            for r, result in enumerate(results):
                reduced = [np.asarray(g) for g in result["partial_tape"][f"{how}_{scale}"]["reduced"]]
                for i in (0, 1):  # the shared layer's kernel and bias: the mean over ranks
                    np.testing.assert_allclose(reduced[i], np.mean([g[i] for g in plain], axis=0), rtol=1e-5)
                for i in (2, 3):  # the local layer's: this rank's own
                    np.testing.assert_allclose(reduced[i], plain[r][i] / (p if scale else 1), rtol=1e-6)
            assert not np.allclose(plain[0][2], plain[1][2])  # the ranks' own gradients do differ
    for result in results:
        local, shared = result["partial_tape"]["split"]
        assert [v.split("/")[-2:] for v in local] == [["local", "kernel"], ["local", "bias"]], local
        assert [v.split("/")[-2:] for v in shared] == [["shared", "kernel"], ["shared", "bias"]], shared


BAD_INPUT = {
    "alltoall_splits": (
        "ValueError",
        "rank {last}'s splits [102, 101] add up to 203 rows, more than its tensor's 5",
    ),
    "alltoall_shape": ("ValueError", "has shape [None, 4] and dtype float32 on rank 1 but shape [None, 3]"),
    "alltoall_uneven": ("ValueError", "rank {last}'s tensor has 5 rows, which do not split evenly over 2"),
    "grouped_allgather_shape": ("ValueError", "tensor 1 of 2 has shape [None, 4]"),
    "allgather_object": ("TypeError", "objects that cannot be pickled (rank {last}: "),
    "broadcast_object_root": ("TypeError", "rank {last}'s object cannot be pickled"),
    "reducescatter_min": ("NotImplementedError", "grouped_reducescatter(op=Min) is not supported"),
    "broadcast_object_compiled": ("RuntimeError", "runs eagerly only"),
    "broadcast_tensor": ("TypeError", "takes variables, but the tensor is a EagerTensor"),
    "alltoall_splits_compiled": ("InvalidArgumentError", "add up to 203 rows, more than its tensor's 5"),
}


def check_bad_input(results: list[dict[str, Any]], p: int) -> None:
    for result in results:
        seen = result["bad_input"]
        for case, (error, message) in BAD_INPUT.items():
            assert seen[case]["error"] == error, (case, seen[case])
            assert message.format(last=p - 1) in seen[case]["message"], (case, seen[case])
        assert seen["after"] == [float(p - 1)]


# One launch per engine for every function: `make test` runs it, `make test-fast` does not.
@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", ["mpi", "tf"])
def test_the_horovod_tensorflow_collectives_on_two_processes(launcher: str, tmp_path: Path) -> None:
    p = 2
    code = processes.launch(launcher, p, tmp_path, [*WORKER, str(tmp_path), ",".join(MODES)])
    assert code == 0, log_tail(tmp_path)
    results = load_results(tmp_path, p)
    assert [r["engine"] for r in results] == [{"engine": launcher, "size": p}] * p
    check_collectives(results, p)
    check_objects(results, p)
    check_sync_batch_norm(results, p)
    check_partial_tape(results, p)
    check_bad_input(results, p)
