"""BroadcastGlobalVariablesCallback: Horovod's broadcast of root's weights and optimizer state."""

from __future__ import annotations

from typing import Any

from tf_adasum._horovod.arguments import unsupported
from tf_adasum.callbacks.base import Callback
from tf_adasum.training.keras_consensus import broadcast_model_and_optimizer, check_equal_steps
from tf_adasum.training.optimizer import AdasumOptimizer


class BroadcastGlobalVariablesCallback(Callback):
    """Every process starts from rank `root_rank`'s model variables and optimizer state (Horovod's).

    Horovod broadcasts after the first batch, because TF1-era optimizers created their state during
    the first step. Keras 3 can build the optimizer before, so this broadcasts before the first batch
    (building the optimizer if Keras has not), and the first step already starts from the same weights
    everywhere; a model Keras builds only in its first step is broadcast after it. It also checks at
    train begin that every process will run the same number of batches per epoch. As
    broadcast_model_and_optimizer says, the optimizer state is broadcast at a fresh start and when only
    root resumed from a checkpoint (Horovod's `if hvd.rank() == 0: model = hvd.load_model(...)`);
    processes that all resumed at the same step keep their own.

    Args:
        root_rank: the rank whose values every process takes.
        local_variables: variables each worker keeps for itself (Horovod's; see
            DistributedOptimizer.register_local_var), which are not broadcast.
    """

    serves_keras_2 = True  # a tf_keras model's variables and its optimizer's state are broadcast alike

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        unsupported("BroadcastGlobalVariablesCallback", device=(device, ""))
        self.root_rank = root_rank
        self.broadcast_done = False
        # Horovod's: variables (or one) that each worker keeps for itself, left out of the broadcast.
        if local_variables is None:
            local_variables = []
        self.local_variables = (
            list(local_variables) if isinstance(local_variables, list | tuple) else [local_variables]
        )

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        check_equal_steps(self.params)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # At the first batch, after every on_train_begin (BackupAndRestore's restore among them). A model
        # Keras builds only in its first step (a Sequential without an Input) has no weights yet: then
        # after the first batch, as Horovod does, or each process would keep its own initialisation.
        if not self.broadcast_done and self.model.weights:
            self._broadcast()
            self.broadcast_done = True

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not self.broadcast_done:
            self._broadcast()
            self.broadcast_done = True

    def _broadcast(self) -> None:
        # Adasum after the optimizer: each process's optimizer state is its own (Keras 3, or tf_keras's).
        optimizer = self.model.optimizer
        per_process = isinstance(optimizer, AdasumOptimizer) or getattr(
            optimizer, "_tf_adasum_state_per_process", False
        )
        broadcast_model_and_optimizer(self.model, self.root_rank, self.local_variables, per_process)
