"""Every private Keras and TensorFlow name tf_adasum depends on, in one place, each checked at import.

tf_adasum changes where Keras sums gradients and what a train step does across processes. It does so
through the hooks of this package; if a Keras or TensorFlow release renamed or reshaped one, training
would not stop, it would quietly run a different algorithm (a gradient mean instead of Adasum, an inner
optimizer that sums gradients already multiplied by N, logs averaged on one process only). So each hook
is registered with a check beside the code that uses it (registry.py), and:

- at import, a missing or changed hook gives one warning naming it, and a Keras or TensorFlow outside
  the tested range (TESTED_KERAS, TESTED_TENSORFLOW; pyproject.toml carries the same bounds) gives a
  warning naming the range;
- whatever needs a missing hook (AdasumStrategy, AdasumOptimizer, AdasumCallback, ...) raises
  HookError when it is created, before any training, instead of degrading.

No other module of tf_adasum touches a private Keras or TensorFlow name (tests/test_fence.py).

The hooks, by module:
- optimizers.py: `optimizers.get`, `_all_reduce_sum_gradients`, `Optimizer.apply`,
  `_distribution_strategy`, `LossScaleOptimizer.check_finite`, `optimizer variables`, `_iterations`,
  `moving average`;
- trainer.py: `train_step / test_step`, `_maybe_symbolic_build`, `epoch iterators`;
- distribute.py: `distributed dataset iterators`, `MirroredExtended._batch_reduce_to`,
  `_create_device_dataset`;
- tracking.py: `tracking` (tf.__internal__.tracking, for checkpoints of every replica's state);
- layers.py: `BatchNormalization._moments` (and `_reduction_axes`);
- losses.py: `loss scaling for distribution`, `tf.nn.compute_average_loss`;
- keras2.py: tf_keras's `Optimizer.aggregate_gradients` and `OptimizerV2._aggregate_gradients`, and its
  CallbackList's questions to a callback, checked where tf_keras is imported (tf_keras objects are told by
  their class, and refused by the ways in that do not serve them);
- outer.py: `tf_keras optimizer index` (which variables a built tf_keras outer optimizer steps), checked
  where tf_keras is imported;
- profiler.py: `profiler.trace.enabled` (whether TensorFlow's profiler records: a function in
  TensorFlow 2.21, a module flag in 2.16 to 2.20);
- numpy_views.py: numpy views of eager tensors (checked on first use).

This package sits at the bottom of tf_adasum: it imports nothing of it but its errors. tf_adasum's own
policies (how to translate an error, what a syncing optimizer needs, which optimizers sync) come in as
arguments to the install_* functions, which tf_adasum/__init__.py calls once: that is every change
`import tf_adasum` makes to Keras.
"""

from tf_adasum._compat.distribute import (
    abort_collectives,
    coordination_service_on,
    hold_iterators,
    install_batch_reduction,
    quiet_per_device_iterators,
    steps_in_cross_replica_context,
)
from tf_adasum._compat.keras2 import (
    Keras2CallbackProtocol,
    install_keras_2_gradient_sum_guard,
    install_keras_2_mixing_guard,
    install_keras_2_step_route,
    is_keras_2_function,
    keras_2_name,
    optimizer_variables,
    refuse_keras_2,
    refuse_mixing_in_keras_3,
    require_keras_3,
)
from tf_adasum._compat.layers import BatchNormalizationMoments
from tf_adasum._compat.losses import install_loss_scaling
from tf_adasum._compat.numpy_views import numpy_views_share_memory, writable_view
from tf_adasum._compat.optimizers import (
    applies,
    disable_gradient_sum,
    install_global_loss_scale_finiteness,
    install_gradient_sum_guard,
    install_optimizer_apply,
    install_optimizer_get,
    loss_scale_inner,
    own_variables,
    running_before_the_moving_average,
    show_moving_averages,
    strategy_of,
    track,
    trainable_variables_of,
    variable_index,
)
from tf_adasum._compat.outer import (
    OUTER_ATTRIBUTE,
    attach_outer,
    attached_outer,
    build_optimizer,
    hang_outer,
    optimizer_name,
    stepped_by_callback,
)
from tf_adasum._compat.profiler import profiler_recording
from tf_adasum._compat.registry import (
    HOOKS,
    TESTED_KERAS,
    TESTED_TENSORFLOW,
    hook_problem,
    require,
    require_tensorflow_backend,
    required_hooks,
    untested_versions,
    warn_at_import,
)
from tf_adasum._compat.tracking import checkpoints_only, parse_tensor, tensors_checkpoint
from tf_adasum._compat.trainer import (
    in_symbolic_build,
    install_iterator_release,
    install_step_hooks,
    install_symbolic_build_mark,
    keras_function_running,
    keras_step,
)

__all__ = [
    "HOOKS",
    "OUTER_ATTRIBUTE",
    "TESTED_KERAS",
    "TESTED_TENSORFLOW",
    "BatchNormalizationMoments",
    "Keras2CallbackProtocol",
    "abort_collectives",
    "applies",
    "attach_outer",
    "attached_outer",
    "build_optimizer",
    "checkpoints_only",
    "coordination_service_on",
    "disable_gradient_sum",
    "hang_outer",
    "hold_iterators",
    "hook_problem",
    "in_symbolic_build",
    "install_batch_reduction",
    "install_global_loss_scale_finiteness",
    "install_gradient_sum_guard",
    "install_iterator_release",
    "install_keras_2_gradient_sum_guard",
    "install_keras_2_mixing_guard",
    "install_keras_2_step_route",
    "install_loss_scaling",
    "install_optimizer_apply",
    "install_optimizer_get",
    "install_step_hooks",
    "install_symbolic_build_mark",
    "is_keras_2_function",
    "keras_2_name",
    "keras_function_running",
    "keras_step",
    "loss_scale_inner",
    "numpy_views_share_memory",
    "optimizer_name",
    "optimizer_variables",
    "own_variables",
    "parse_tensor",
    "profiler_recording",
    "quiet_per_device_iterators",
    "refuse_keras_2",
    "refuse_mixing_in_keras_3",
    "require",
    "require_keras_3",
    "require_tensorflow_backend",
    "required_hooks",
    "running_before_the_moving_average",
    "show_moving_averages",
    "stepped_by_callback",
    "steps_in_cross_replica_context",
    "strategy_of",
    "tensors_checkpoint",
    "track",
    "trainable_variables_of",
    "untested_versions",
    "variable_index",
    "warn_at_import",
    "writable_view",
]
