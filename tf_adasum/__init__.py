"""tf_adasum: Adasum (adaptive summation) for TensorFlow 2 and Keras 3.

This is the public face, and the one place where importing tf_adasum changes Keras: the
install_* calls below (each hook is described beside its check, in the _compat package). AdasumStrategy
also turns tf.data autotuning off on per-device prefetch datasets when it is created
(_compat.quiet_per_device_iterators).

`python -m tf_adasum.run`, the launcher, imports this package before it runs and needs none of it:
there nothing below the check is imported, TensorFlow included (5 s of CPU per launch here). So it is
for `python -m tf_adasum.launch.relay`, which the elastic launcher starts for every warm process.
"""

import sys

_WITHOUT_TENSORFLOW = ("tf_adasum.run", "tf_adasum.launch.relay")


def _the_launcher_alone() -> bool:
    """Whether this import is Python's, locating `-m tf_adasum.run` or another module of
    _WITHOUT_TENSORFLOW (sys.argv[0] is "-m" until then)."""
    argv = list(getattr(sys, "orig_argv", []))
    module = argv[argv.index("-m") + 1 :][:1] if "-m" in argv else []
    return sys.argv[:1] == ["-m"] and len(module) == 1 and module[0] in _WITHOUT_TENSORFLOW


if not _the_launcher_alone():
    import functools
    import importlib.metadata

    from tf_adasum.common import quiet as _quiet

    # The demo and the examples start without TensorFlow's C++ start-up log (see _quiet). The imports below
    # import TensorFlow, so this comes first.
    if _quiet.wanted():
        _quiet.import_tensorflow_quietly()

    from tf_adasum import _compat, callbacks, ops
    from tf_adasum.algorithm.tree import adasum_tree
    from tf_adasum.callbacks import AdasumCallback
    from tf_adasum.comm import engine
    from tf_adasum.common import errors
    from tf_adasum.common.errors import HookError, NonFiniteUpdateError, PeerError, UnevenDataError
    from tf_adasum.distributed import (
        Adasum,
        Average,
        ReduceOp,
        Sum,
        allreduce,
        broadcast,
        cross_rank,
        cross_size,
        init,
        is_initialized,
        launched_for_the_tf_engine,
        local_rank,
        local_size,
        rank,
        shutdown,
        size,
    )
    from tf_adasum.training import loss_scaling, model_sync, optimizer, strategy
    from tf_adasum.training.allreduce_optimizer import AllreduceOptimizer
    from tf_adasum.training.optimizer import AdasumOptimizer
    from tf_adasum.training.strategy import AdasumStrategy

    __all__ = [
        "Adasum",
        "AdasumCallback",
        "AdasumOptimizer",
        "AdasumStrategy",
        "AllreduceOptimizer",
        "Average",
        "HookError",
        "NonFiniteUpdateError",
        "PeerError",
        "ReduceOp",
        "Sum",
        "UnevenDataError",
        "adasum_tree",
        "allreduce",
        "broadcast",
        "callbacks",
        "cross_rank",
        "cross_size",
        "init",
        "is_initialized",
        "local_rank",
        "local_size",
        "ops",
        "rank",
        "shutdown",
        "size",
    ]
    __version__ = importlib.metadata.version("tf_adasum")  # the one place is pyproject.toml

    # Everything importing tf_adasum changes in Keras, each with tf_adasum's policy passed in.
    _compat.warn_at_import()
    # compile() resolves its optimizer through keras.optimizers.get: under an AdasumStrategy, AdasumOptimizer.
    _compat.install_optimizer_get(strategy.wrap_under_adasum_strategy, _compat.refuse_mixing_in_keras_3)
    _compat.install_keras_2_mixing_guard()  # where tf_keras is imported already; the ways in too

    def _before_train_function(model: object) -> None:
        strategy.adopt_optimizer_compiled_outside(model)
        optimizer.build_before_the_trace(model)
        model_sync.without_xla(model)

    # Keras's train and test functions: tf_adasum's errors translated; before a train function, an optimizer
    # compiled outside an AdasumStrategy's scope made an AdasumOptimizer, a wrapper built before the step is
    # traced (not in the trace, which made TensorFlow trace the step twice), and XLA off where a step syncs.
    _compat.install_step_hooks(
        functools.partial(errors.translate_errors, current_comm=engine.current),
        _before_train_function,
        strategy.losses_unscaled_for,
    )
    # Keras's loss scaling by the number of replicas: off in a train step of a model that runs Adasum, so
    # each replica's loss is its own however it is built; seen in custom loops (training/loss_scaling.py).
    _compat.install_loss_scaling(loss_scaling.unscaled, loss_scaling.note_scaled)
    # Mixed precision skips a step everywhere when any replica of a syncing optimizer overflowed.
    _compat.install_global_loss_scale_finiteness(model_sync.syncs, model_sync.finite_everywhere)
    # Under an AdasumStrategy a plain optimizer's step in a strategy.run loop runs as an AdasumOptimizer's,
    # and nothing sums the replicas' gradients.
    _compat.install_optimizer_apply(strategy.adasum_for)
    _compat.install_gradient_sum_guard(strategy.refuse_gradient_mean)
    # Keras's build on one batch reduces it for its shapes only: AdasumStrategy keeps that in the process.
    _compat.install_symbolic_build_mark()
    # fit, evaluate and predict free their data iterators off the training thread: on a busy host a
    # destructor took seconds after fit's last batch while the other ranks waited in a collective.
    _compat.install_iterator_release()

    def _start_as_launched() -> None:
        """What the process's launcher asks of tf_adasum before the script runs, from the environment:
        at import, and in a warm process of the elastic launcher's pool once it has its place
        (tf_adasum/elastic/standby.py)."""
        # TensorFlow's collective runtime must be configured before TensorFlow runs its first op, and a
        # script imports tf_adasum before it builds its model: a process that horovodrun (Gloo mode) or
        # `python -m tf_adasum.run` started for the TF engine starts it here.
        if launched_for_the_tf_engine():
            init()
        # Under `tf_adasum.run --elastic`, a peer lost before the training function (a collective in the
        # script's own start) still passes this process's commits on to the next group.
        from tf_adasum import elastic

        if elastic.launched():
            elastic.install_excepthook()

    _start_as_launched()
