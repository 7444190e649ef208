"""The package's floors, bottom first: tests/test_layers.py checks every import against them, and
tests/test_docs.py the design page's table."""

from __future__ import annotations

FLOORS: list[list[str]] = [
    # leaves: the layer folders' faces, settings, the quiet start, Keras variables, tensor lists and their
    # checks, compression, loss scaling; the launcher's hosts, its private files and its key
    [
        "common",
        "common.settings",
        "common.quiet",
        "common.variables",
        "algorithm",
        "algorithm.compression",
        "algorithm.tensor_lists",
        "comm",
        "training",
        "training.loss_scaling",
        "launch",
        "launch.elastic",
        "launch.hosts",
        "launch.private_files",
        "launch.secret",
        "_horovod",
        "_compat.numpy_views",
    ],
    # errors; the compiled library's loader; Horovod's compression; the launcher's services and output
    [
        "common.errors",
        "common.loader",
        "_horovod.compression",
        "launch.service",
        "launch.output",
        "launch.supervise",
    ],
    # the registry of private Keras and TensorFlow hooks; the ops; the communicator interface; the
    # elastic launcher's protocol with its processes
    ["_compat.registry", "ops", "comm.base", "launch.protocol"],
    # each hook, by subject; the contract tree; what ranks check before data moves; the elastic
    # launcher's rules, its pool of warm processes and its copies of the commits
    [
        "_compat.optimizers",
        "_compat.trainer",
        "_compat.distribute",
        "_compat.tracking",
        "_compat.layers",
        "_compat.profiler",
        "_compat.losses",
        "_compat.keras2",
        "algorithm.tree",
        "algorithm.agreement",
        "launch.elastic.policy",
        "launch.elastic.pool",
        "launch.elastic.commits",
    ],
    # where AdasumCallback's outer optimizer hangs, with its checks
    ["_compat.outer"],
    # the fence's face; the elastic launcher's discovery of slots; a warm process's relay
    ["_compat", "launch.elastic.discovery", "launch.relay"],
    # the Timeline; every replica's optimizer state; the Keras 3 callbacks' base; a launch's settings
    ["timeline", "training.replica_optimizer_state", "callbacks.base", "launch.settings"],
    # the fused buffer; the learning-rate schedule; the static launch and the elastic one
    ["algorithm.fusion", "callbacks.learning_rate_schedule", "launch.static", "launch.elastic.driver"],
    # the algorithms on one buffer; Adasum across processes, asked of the engine; the command line
    ["algorithm.vhdd", "algorithm.fused_adasum", "launch.cli"],
    # the engines' two paths: with TensorFlow ops, and on host memory; `python -m tf_adasum.run`
    ["algorithm.in_graph", "algorithm.on_host", "run"],
    # the engines, each with its path
    ["comm.mpi", "comm.tf_collective"],
    # this process's engine
    ["comm.engine"],
    # the public collectives; Horovod's process sets; elastic state
    ["distributed", "_horovod.process_sets", "elastic.state"],
    # the model sync; Keras's optimizer options under it; Keras state processes share; BatchNorm over
    # processes; TensorFlow and Keras elastic state; Horovod's argument rules; two callbacks that need
    # only the collectives
    [
        "training.model_sync",
        "training.optimizer_options",
        "training.keras_consensus",
        "training.sync_batch_norm",
        "elastic.keras",
        "_horovod.arguments",
        "callbacks.best_model_checkpoint",
        "callbacks.learning_rate_warmup",
    ],
    # AdasumOptimizer; the sync on a tf_keras optimizer; hvd.elastic; Horovod's basics, collectives and
    # functions; what two callbacks share
    [
        "training.optimizer",
        "training.keras2_sync",
        "elastic",
        "_horovod.basics",
        "_horovod.mpi_ops",
        "_horovod.functions",
        "callbacks.batches",
    ],
    # the entry points: AllreduceOptimizer, the strategy, the callbacks (one per file); Horovod's tape
    [
        "training.allreduce_optimizer",
        "training.strategy",
        "callbacks.adasum",
        "callbacks.broadcast",
        "callbacks.metric_average",
        "callbacks.orthogonality",
        "_horovod.gradient_tape",
        "_horovod.keras2_optimizer",
    ],
    # the callbacks' face; Horovod's optimizers
    ["callbacks", "_horovod.optimizers"],
    # the public face, the one place that patches Keras; Horovod's TensorFlow face
    ["__init__", "tensorflow"],
    # Horovod's Keras face; the demo; a warm process of the elastic launcher's pool
    ["keras", "demo", "elastic.standby"],
    # the fork server of the elastic launcher's pool, which runs a warm process's standby in each fork
    ["elastic.forkserver"],
]
