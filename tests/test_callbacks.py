"""In one process: the callbacks, tf_adasum.keras, the agreement table and error translation. The same
code across real processes is in test_existing_scripts.py."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_adasum
import tf_adasum.keras as hvd
import tf_adasum.tensorflow
from tests.support.training import build_linear, cpus, make_inner, problem
from tf_adasum import distributed
from tf_adasum.algorithm import agreement
from tf_adasum.comm import engine
from tf_adasum.common import errors, settings
from tf_adasum.training import keras_consensus, model_sync


def test_adasum_callback_in_one_process_trains_as_the_plain_optimizer(tmp_path: Path) -> None:
    x, y, _, _ = problem()
    plain = build_linear(tf.distribute.get_strategy(), lambda: make_inner("adam"))
    plain.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    user_optimizer = make_inner("adam")
    model = build_linear(tf.distribute.get_strategy(), lambda: user_optimizer)
    model.fit(
        x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[tf_adasum.AdasumCallback(sync_every=2)]
    )
    for a, b in zip(plain.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # a world of one: the sync changes nothing
    assert model.optimizer is user_optimizer and "apply" not in vars(user_optimizer)

    # The model saved after fit loads in a process that never imports tf_adasum.
    model.save(tmp_path / "model.keras")
    code = (
        "import sys, keras; m = keras.models.load_model(sys.argv[1]); "
        "assert 'tf_adasum' not in sys.modules; print(type(m.optimizer).__name__)"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "model.keras")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert loaded.returncode == 0 and loaded.stdout.strip() == "Adam", loaded.stderr[-2000:]


def test_adasum_callback_refuses_strategies_and_wrapped_optimizers() -> None:
    x, y, _, _ = problem()
    with pytest.raises(ValueError, match="sync_every must be a positive integer, got 0"):
        tf_adasum.AdasumCallback(sync_every=0)
    strategy = tf.distribute.MirroredStrategy(cpus(2), cross_device_ops=tf.distribute.ReductionToOneDevice())
    model = build_linear(strategy, lambda: make_inner("sgd_momentum"))
    with pytest.raises(ValueError, match=r"use tf_adasum\.AdasumStrategy instead"):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[tf_adasum.AdasumCallback()])
    model = build_linear(tf.distribute.get_strategy(), lambda: tf_adasum.AdasumOptimizer(make_inner("adam")))
    with pytest.raises(ValueError, match="use either it or AdasumCallback, not both"):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[tf_adasum.AdasumCallback()])


class RecordRates(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.rates: list[float] = []

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


def test_learning_rate_schedule_callback_follows_horovods_formula() -> None:
    x, y, _, _ = problem()
    model = build_linear(tf.distribute.get_strategy(), lambda: keras.optimizers.Adam(1.0))
    record = RecordRates()
    schedule = hvd.callbacks.LearningRateScheduleCallback(0.8, multiplier=0.5, start_epoch=1, end_epoch=3)
    history = model.fit(x, y, batch_size=16, epochs=4, verbose=0, callbacks=[schedule, record])
    # Epoch 0: not adjusted yet; epochs 1 and 2: 0.8 * 0.5 ** (epoch - start_epoch) at their first batch
    # (Horovod's formula since 2021; before, ** epoch); then left alone.
    assert record.rates == pytest.approx([1.0] * 4 + [0.8] * 4 + [0.4] * 4 + [0.4] * 4)
    assert history.history["lr"] == pytest.approx([1.0, 0.8, 0.4, 0.4])

    record = RecordRates()
    smooth = hvd.callbacks.LearningRateScheduleCallback(1.0, multiplier=lambda e: e, staircase=False)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[smooth, record])
    assert record.rates == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75])


def test_learning_rate_warmup_reaches_initial_lr_and_warns_about_keras_momentum() -> None:
    x, y, _, _ = problem()
    model = build_linear(tf.distribute.get_strategy(), lambda: keras.optimizers.SGD(0.1, momentum=0.9))
    record = RecordRates()
    warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.3, warmup_epochs=2)
    with pytest.warns(UserWarning, match="momentum_correction cannot change the momentum"):
        model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[warmup, record])
    # One process: size 1, so the warm-up multiplier is 1 throughout (Horovod's formula).
    assert record.rates == pytest.approx([0.3] * 12)


def test_metric_average_and_broadcast_are_identities_in_a_world_of_one() -> None:
    logs = {"loss": 0.5, "accuracy": np.float32(0.25), "name": "kept"}
    assert keras_consensus.average_logs(logs) == logs
    variable = tf.Variable([1.0, 2.0])
    hvd.broadcast_variables([variable], root_rank=0)
    np.testing.assert_array_equal(variable.numpy(), [1.0, 2.0])
    with pytest.raises(NotImplementedError, match="device='/gpu:0'"):
        hvd.callbacks.MetricAverageCallback(device="/gpu:0")


def test_horovod_api_in_one_process() -> None:
    hvd.init()
    assert hvd.is_initialized() and (hvd.size(), hvd.rank(), hvd.local_size(), hvd.local_rank()) == (
        1,
        0,
        1,
        0,
    )
    assert (hvd.cross_size(), hvd.cross_rank()) == (1, 0)
    np.testing.assert_array_equal(hvd.allreduce([1.0, 3.0]), [1.0, 3.0])
    np.testing.assert_array_equal(hvd.allreduce([1.0, 3.0], op=hvd.Sum), [1.0, 3.0])
    np.testing.assert_array_equal(hvd.broadcast(np.arange(3), root_rank=0), np.arange(3))
    np.testing.assert_array_equal(hvd.allgather(np.ones((2, 3))), np.ones((2, 3)))
    with pytest.raises(ValueError, match="pass op or average, not both"):
        hvd.allreduce(1.0, average=True, op=hvd.Sum)
    hvd.shutdown()
    assert not hvd.is_initialized()
    hvd.init()
    assert hvd.is_initialized()


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("device_dense", "/gpu:0"),
        ("gradient_predivide_factor", 2.0),
        ("process_set", object()),
    ],
)
def test_distributed_optimizer_names_what_it_does_not_implement(argument: str, value: Any) -> None:
    with pytest.raises(NotImplementedError, match=rf"DistributedOptimizer\({argument}="):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), **{argument: value})


def test_groups_split_the_gradients_as_horovod_does_and_go_out_last_first() -> None:
    grads = [tf.zeros([n]) for n in (4, 4, 4, 4, 4)]
    variables = [tf.Variable(tf.zeros([4]), name=f"v{i}") for i in range(5)]
    assert distributed.gradient_groups(grads, variables, None, "t") == [[0, 1, 2, 3, 4]]
    assert distributed.gradient_groups(grads, variables, 2, "t") == [[3, 4], [0, 1, 2]]
    assert distributed.gradient_groups(grads, variables, 9, "t") == [[4], [3], [2], [1], [0]]
    # Listed variables together, every other variable alone (Horovod's rule); Keras variables match too.
    got = distributed.gradient_groups(grads, variables, [[variables[3], variables[0]], [variables[2]]], "t")
    assert got == [[4], [1], [2], [0, 3]]
    with pytest.raises(ValueError, match="is in groups 0 and 1"):
        distributed.gradient_groups(grads, variables, [[variables[0]], [variables[0]]], "t")
    with pytest.raises(ValueError, match=r"groups\[0\] is a ResourceVariable; expected a list"):
        distributed.gradient_groups(grads, variables, [variables[0]], "t")
    with pytest.raises(ValueError, match="expected a number of groups, 0 or more"):
        distributed.gradient_groups(grads, variables, -1, "t")
    with pytest.raises(ValueError, match="pass groups or num_groups, not both"):
        tf_adasum.tensorflow.DistributedGradientTape(tf.GradientTape(), num_groups=2, groups=3)
    with pytest.raises(NotImplementedError, match=r"op=Adasum, groups=2.*DistributedGradientTape"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Adasum, num_groups=2)
    assert hvd.DistributedOptimizer(keras.optimizers.SGD(), num_groups=3).groups == 3


def test_buckets_are_cut_from_the_last_gradient_back_in_a_traced_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grads = [tf.zeros([n], tf.float32) for n in (1 << 18, 1 << 16, 1 << 18, 1 << 18)]  # 1, 1/4, 1, 1 MB

    def traced_groups() -> list[list[int]]:
        groups: list[list[int]] = []
        tf.function(lambda: groups.extend(distributed.gradient_groups(grads, None, None, "t")))()
        return groups

    monkeypatch.setenv("TF_ADASUM_BUCKET_MB", "1.2")
    assert traced_groups() == [[2, 3], [0, 1]]
    assert distributed.gradient_groups(grads, None, None, "t") == [[0, 1, 2, 3]]  # eagerly: one call
    monkeypatch.setenv("TF_ADASUM_BUCKET_MB", "0")
    assert traced_groups() == [[0, 1, 2, 3]]
    monkeypatch.setenv("TF_ADASUM_BUCKET_MB", "lots")
    with pytest.raises(ValueError, match="TF_ADASUM_BUCKET_MB='lots'; expected megabytes"):
        settings.bucket_bytes()


def test_distributed_optimizer_chooses_by_op() -> None:
    adasum = hvd.DistributedOptimizer(
        keras.optimizers.Adam(), op=hvd.Adasum, backward_passes_per_step=3, compression=hvd.Compression.fp16
    )
    assert isinstance(adasum, tf_adasum.AdasumOptimizer) and adasum.sync_every == 3
    assert adasum.compression == "fp16"
    average = hvd.DistributedOptimizer(keras.optimizers.Adam(), op=hvd.Sum)
    assert isinstance(average, tf_adasum.AllreduceOptimizer) and average.op is hvd.Sum
    accumulating = hvd.DistributedOptimizer(keras.optimizers.Adam(), backward_passes_per_step=2)
    assert isinstance(accumulating, tf_adasum.AllreduceOptimizer)
    assert accumulating.backward_passes_per_step == 2
    with pytest.raises(ValueError, match="nothing is aggregated"):
        hvd.DistributedOptimizer(
            keras.optimizers.Adam(),
            op=hvd.Adasum,
            backward_passes_per_step=2,
            average_aggregated_gradients=True,
        )
    # Both serialize, so a model compiled with them saves and loads.
    for optimizer in (adasum, average):
        again = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
        assert type(again) is type(optimizer) and again.get_config() == optimizer.get_config()


def test_the_agreement_table_names_the_rank_and_the_tensor() -> None:
    sync, end = agreement.SYNC, agreement.EPOCH_END
    agreement.raise_unless_agreed(np.array([[sync, -1], [sync, -1]]))
    agreement.raise_unless_agreed(np.array([[end, 7], [end, 7]]))
    with pytest.raises(tf_adasum.NonFiniteUpdateError, match=r"rank\(s\) \[1\].*tensor 2 of 3 \(d/kernel\)"):
        agreement.raise_unless_agreed(np.array([[sync, -1], [sync, 2]]), 3, ["a", "b", "d/kernel"])
    with pytest.raises(tf_adasum.UnevenDataError, match=r"rank\(s\) \[0\] ran out of data \(rank 0 after 5"):
        agreement.raise_unless_agreed(np.array([[end, 5], [sync, -1]]))
    with pytest.raises(tf_adasum.UnevenDataError, match="rank 0: 5, rank 1: 6"):
        agreement.raise_unless_agreed(np.array([[end, 5], [end, 6]]))
    # Mixed precision's check: one rank's overflow is an answer, not an error; meeting a rank at
    # another check, or at its epoch end, is.
    scale = agreement.LOSS_SCALE
    agreement.raise_unless_agreed(np.array([[scale, 0], [scale, 1]]))
    with pytest.raises(RuntimeError, match="rank 0: a model sync, rank 1: a mixed-precision check"):
        agreement.raise_unless_agreed(np.array([[sync, -1], [scale, 0]]))
    with pytest.raises(tf_adasum.UnevenDataError, match=r"rank\(s\) \[1\] ran out of data"):
        agreement.raise_unless_agreed(np.array([[scale, 0], [end, 3]]))


def test_the_agreement_compares_the_fingerprints_of_the_tensors() -> None:
    sync, end = agreement.SYNC, agreement.EPOCH_END
    a = agreement.fingerprint([tf.zeros([4, 5]), tf.zeros([2], tf.float16)])
    assert a == agreement.fingerprint([tf.ones([4, 5]), tf.ones([2], tf.float16)])  # values do not count
    b = agreement.fingerprint([tf.zeros([4, 6]), tf.zeros([2], tf.float16)])
    c = agreement.fingerprint([tf.zeros([4, 5]), tf.zeros([2], tf.float32)])
    assert len({a, b, c}) == 3 and all(0 <= f < 2**63 for f in (a, b, c))
    agreement.raise_unless_agreed(np.array([[sync, -1, a], [sync, -1, a]]))
    with pytest.raises(agreement.MetadataDiffers, match="rank 1"):
        agreement.raise_unless_agreed(np.array([[sync, -1, a], [sync, -1, b]]))
    # A rank at its epoch end meets a sync: that is the error, whatever the fingerprints.
    with pytest.raises(tf_adasum.UnevenDataError):
        agreement.raise_unless_agreed(np.array([[sync, -1, a], [end, 3, 0]]))


def test_errors_raised_inside_a_compiled_step_come_back_as_tf_adasums() -> None:
    def raise_in_graph(_: np.ndarray) -> np.ndarray:
        raise tf_adasum.NonFiniteUpdateError("the update of rank(s) [1] is not finite")

    @tf.function
    def step(x: tf.Tensor) -> tf.Tensor:
        return tf.numpy_function(raise_in_graph, [x], tf.float32, stateful=True)

    with pytest.raises(tf.errors.OpError):  # what TensorFlow alone makes of it
        step(tf.ones(2))
    with pytest.raises(
        tf_adasum.NonFiniteUpdateError, match=r"^the update of rank\(s\) \[1\] is not finite$"
    ):
        errors.translate_errors(step, engine.current)(tf.ones(2))


def test_a_lost_peer_error_says_which_watcher_noticed_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_ADASUM_TIMEOUT_SECONDS", "15")
    comm = types.SimpleNamespace(rank=0, size=3, peer_of=lambda message: 1 if "task:1" in message else None)
    heartbeats = tf.errors.UnavailableError(
        None,
        None,
        "Collective ops is aborted by: Error reported from /job:worker/task:1: The following "
        "tasks are unhealthy (stopped sending heartbeats):",
    )
    told = str(errors.translate(heartbeats, comm))
    assert told.startswith("rank 0: lost rank 1 during a compiled step (TensorFlow's coordination service ")
    assert "TF_ADASUM_TIMEOUT_SECONDS" not in told
    unanswered = tf.errors.DeadlineExceededError(
        None,
        None,
        "Collective ops is aborted by: Deadline Exceeded\n\nRPC: /tensorflow.CoordinationService/Heartbeat",
    )
    told = str(errors.translate(unanswered, comm))
    assert "(TensorFlow's coordination service did not answer this process's heartbeats: its host" in told
    assert told.endswith("DeadlineExceededError: Collective ops is aborted by: Deadline Exceeded")
    timed_out = tf.errors.DeadlineExceededError(None, None, "Collective has timed out waiting for others")
    assert "did not answer within TF_ADASUM_TIMEOUT_SECONDS=15 s" in str(errors.translate(timed_out, comm))
    closed = tf.errors.UnavailableError(None, None, "Socket closed")
    assert "(the connection to it failed: it died or is cut off)" in str(errors.translate(closed, comm))
    assert str(errors.translate(closed, comm)).startswith("rank 0: lost a peer during")


def test_engine_detection_reads_horovodrun_and_the_launchers() -> None:
    gloo = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1", "HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}
    assert engine.detect_engine(gloo) == "tf"
    assert engine.launched_for_the_tf_engine(gloo)
    assert engine.detect_engine({"OMPI_COMM_WORLD_SIZE": "2", **gloo}) == "mpi"  # horovodrun --mpi
    assert not engine.launched_for_the_tf_engine({"OMPI_COMM_WORLD_SIZE": "2", **gloo})
    assert not engine.launched_for_the_tf_engine({"TF_CONFIG": "{}"})  # the user calls init()
    assert engine.launched_for_the_tf_engine({"TF_CONFIG": "{}", "TF_ADASUM_LAUNCHER": "1"})
    assert engine.detect_engine({"TF_ADASUM_ENGINE": "single", **gloo}) == "single"
    with pytest.raises(ValueError, match=r"TF_ADASUM_ENGINE='gloo'; expected one of"):
        engine.detect_engine({"TF_ADASUM_ENGINE": "gloo"})


def test_a_fit_that_raised_leaves_no_second_sync_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            raise RuntimeError("interrupted")

    traced_syncs: list[int] = []
    real_sync = model_sync.sync_if_due

    def counting_sync(*args: Any, **kwargs: Any) -> None:  # runs when the train step is traced
        traced_syncs.append(1)
        real_sync(*args, **kwargs)

    monkeypatch.setattr(model_sync, "sync_if_due", counting_sync)
    x, y, _, _ = problem()
    optimizer = make_inner("sgd_momentum")
    model = build_linear(tf.distribute.get_strategy(), lambda: optimizer)
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[tf_adasum.AdasumCallback(), Interrupt()])
    assert "apply" in vars(optimizer)  # on_train_end never ran
    after_a_failure = len(traced_syncs)
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[tf_adasum.AdasumCallback()])
    assert len(traced_syncs) - after_a_failure == after_a_failure  # one sync per step, not two
    assert "apply" not in vars(optimizer)


# horovod.tensorflow.keras 0.28.1's public names (dir() of the module, less the modules it imports and
# its is_version_greater_equal_than helper), and those of its callbacks module.
HOROVOD_KERAS_NAMES = (
    "Average Compression DistributedOptimizer ProcessSet Sum add_process_set allgather allreduce broadcast "
    "broadcast_global_variables callbacks ccl_built cross_rank cross_size cuda_built ddl_built elastic "
    "global_process_set gloo_built gloo_enabled init is_initialized load_model local_rank local_size "
    "mpi_built mpi_enabled mpi_threads_supported nccl_built rank reducescatter remove_process_set "
    "rocm_built shutdown size start_timeline stop_timeline"
).split()
HOROVOD_KERAS_CALLBACKS = (
    "BestModelCheckpoint BroadcastGlobalVariablesCallback LearningRateScheduleCallback "
    "LearningRateWarmupCallback MetricAverageCallback"
).split()


def test_every_name_of_horovods_keras_module_exists_and_says_what_it_does(tmp_path: Path) -> None:
    assert len(HOROVOD_KERAS_NAMES) == 37
    missing = [n for n in HOROVOD_KERAS_NAMES if not hasattr(hvd, n)]
    missing += [f"callbacks.{n}" for n in HOROVOD_KERAS_CALLBACKS if not hasattr(hvd.callbacks, n)]
    assert not missing, missing
    assert set(HOROVOD_KERAS_NAMES) <= set(hvd.__all__)
    hvd.init()
    # Capability queries, as Horovod answers them for what runs here.
    assert hvd.mpi_built() is True  # mpi4py is installed
    assert hvd.mpi_enabled() is False and hvd.mpi_threads_supported() is False  # the single engine
    assert (hvd.gloo_built(), hvd.gloo_enabled(), hvd.nccl_built()) == (False, False, 0)
    assert (hvd.ddl_built(), hvd.ccl_built(), hvd.rocm_built()) == (False, False, False)
    assert hvd.cuda_built() is False  # this CPU build of the ops
    # The rest: implemented, or an error that names it and the alternative.
    with pytest.raises(ValueError, match="the model must be built first"):  # elastic: tests/test_elastic.py
        hvd.elastic.KerasState(keras.Sequential())
    hvd.start_timeline(str(tmp_path / "timeline.json"))  # tests/test_timeline.py reads timelines back
    hvd.stop_timeline()
    assert (tmp_path / "timeline.json").read_text().rstrip().endswith("]")
    with pytest.raises(NotImplementedError, match="every collective runs over all processes"):
        hvd.ProcessSet([0])
    with pytest.raises(NotImplementedError, match="every collective runs over all processes"):
        hvd.add_process_set([0])
    with pytest.raises(NotImplementedError, match=r"hvd.broadcast_variables\(model.variables, root_rank=0\)"):
        hvd.broadcast_global_variables(0)
    # global_process_set is every rank, and accepted where Horovod takes process_set=.
    assert hvd.global_process_set.ranks == [0] and hvd.global_process_set.included()
    value = tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    np.testing.assert_array_equal(
        tf_adasum.tensorflow.allreduce(value, process_set=hvd.global_process_set), value
    )
    np.testing.assert_array_equal(hvd.reducescatter(value, op=hvd.Sum), value)  # one process: all rows
    with pytest.raises(NotImplementedError, match="reducescatter"):
        hvd.reducescatter(value, op=hvd.Adasum)


def test_best_model_checkpoint_keeps_the_best_model(tmp_path: Path) -> None:
    x, y, _, _ = problem()
    with pytest.raises(ValueError, match="pass filepath="):
        build_linear(tf.distribute.get_strategy(), lambda: make_inner("adam")).fit(
            x, y, epochs=1, verbose=0, callbacks=[hvd.callbacks.BestModelCheckpoint(monitor="loss")]
        )
    model = build_linear(tf.distribute.get_strategy(), lambda: make_inner("adam"))
    best = hvd.callbacks.BestModelCheckpoint(monitor="loss", filepath=str(tmp_path / "best.keras"))
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[best])
    assert best.save_best_only and (tmp_path / "best.keras").exists()
    assert best.best == pytest.approx(min(history.history["loss"]))


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_gradient_accumulation_follows_horovods_formula(k: int, average: bool) -> None:
    # Horovod's LocalGradientAggregationHelper: k passes' gradients summed locally (divided by k with
    # average_aggregated_gradients), all-reduced once, applied at every k-th pass; the iteration count
    # moves at every pass, so Adam's bias correction counts passes. One process here; across processes
    # in test_existing_scripts.py.
    from tests.support.training import accumulated_adam

    x, y, _, _ = problem()
    optimizer = hvd.DistributedOptimizer(
        make_inner("adam"), op=hvd.Average, backward_passes_per_step=k, average_aggregated_gradients=average
    )
    model = build_linear(tf.distribute.get_strategy(), lambda: optimizer)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)  # 8 passes
    params = accumulated_adam(k, average)
    for got, want in zip(model.get_weights(), params, strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert int(optimizer.iterations.numpy()) == 8
    restored = type(optimizer).from_config(optimizer.get_config())
    assert restored.get_config() == optimizer.get_config()  # Horovod's test_from_config


def test_an_inf_gradient_is_cleared_with_its_accumulation_cycle() -> None:
    # Horovod's test_grad_aggregation_with_inf_grad: the first cycle's Inf does not reach the second.
    x = keras.Variable(0.0)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    optimizer.build([x])
    accumulated = []
    for step in range(4):
        gradient = tf.constant(float("inf") if step == 0 else 1.0)
        optimizer.apply([gradient], [x])
        accumulated.append(float(optimizer._accumulated[0].numpy()))
    assert accumulated == [float("inf"), 0.0, 1.0, 0.0]
    assert int(optimizer.iterations.numpy()) == 4


class CustomRMSprop(keras.optimizers.RMSprop):
    """Not registered with Keras: the loader finds it only through custom_optimizers or custom_objects."""


def test_load_model_as_horovod_scripts_call_it(tmp_path: Path) -> None:
    # Horovod's test_load_model*: the defaults, custom_optimizers, the custom_objects factory idiom,
    # and keras_imagenet_resnet50.py's compression=hvd.Compression.none.
    x, y, _, _ = problem()
    model = build_linear(tf.distribute.get_strategy(), lambda: hvd.DistributedOptimizer(CustomRMSprop(0.01)))
    model.fit(x, y, batch_size=16, verbose=0)
    model.save(tmp_path / "m.keras")
    saved = [v.numpy() for v in model.optimizer.variables]
    factory = {"CustomRMSprop": lambda **kwargs: hvd.DistributedOptimizer(CustomRMSprop(**kwargs))}
    for kwargs in (
        {"custom_optimizers": [CustomRMSprop], "compression": hvd.Compression.none},
        {"custom_objects": factory},
        {"custom_optimizers": [CustomRMSprop], "compression": hvd.Compression.fp16},
    ):
        loaded = hvd.load_model(tmp_path / "m.keras", **kwargs)
        optimizer = loaded.optimizer
        assert isinstance(optimizer, tf_adasum.AllreduceOptimizer), kwargs
        assert type(optimizer.inner_optimizer) is CustomRMSprop, kwargs
        assert optimizer.compression == kwargs.get("compression", hvd.Compression.none).name
        for mine, theirs in zip(optimizer.variables, saved, strict=True):
            np.testing.assert_array_equal(mine.numpy(), theirs)  # the state comes back for retraining
    with pytest.raises(NotImplementedError, match="compression"):
        hvd.load_model(tmp_path / "m.keras", custom_optimizers=[CustomRMSprop], compression=object())


def test_adasum_callback_refuses_a_model_without_weights_yet() -> None:
    # A Sequential without an Input has no weights until its first step: the sync would combine none.
    model = keras.Sequential([keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y, _, _ = problem()
    with pytest.raises(ValueError, match=r"no weights yet.*keras\.Input"):
        model.fit(x, y, verbose=0, callbacks=[tf_adasum.AdasumCallback()])
