"""OrthogonalityMonitor: how orthogonal the replicas' updates were, per layer (the paper's Figure 1)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from tf_adasum import _compat, distributed
from tf_adasum.algorithm import agreement
from tf_adasum.callbacks.base import Callback
from tf_adasum.callbacks.batches import retrace_with, retrace_without
from tf_adasum.training import model_sync


class OrthogonalityMonitor(Callback):
    """Reports, per trainable variable, how orthogonal the replicas' updates were at the last sync.

    The value is `|adasum(d_1, ..., d_n)|^2 / sum_i |d_i|^2` over the n replicas (of every process) and
    their deltas d_i since the previous sync: 1 when the updates were orthogonal, where Adasum adds
    them; 1/n when they were all equal, where Adasum returns one of them; between for a mix. It is the
    paper's Figure 1 diagnostic: how much of the extra replicas' work Adasum keeps.

    Every `every` optimizer steps, and at each epoch end, the values go into `logs` as
    `orthogonality/<variable path>`, with their mean over variables as `orthogonality`;
    `history` keeps (step, values) for every report. A keras.callbacks.TensorBoard placed after this
    callback in the list writes them as scalars. Works under AdasumStrategy, with AdasumOptimizer
    (tf_adasum.keras.DistributedOptimizer(op=Adasum)), and with AdasumCallback, on Keras 3 and on
    tf_keras models alike. Across processes, add it
    on every process: the recording joins a collective at every sync (a process without one is named in
    a PeerError at train begin).

    Cost: the syncs record two squared norms per variable (one pass over each delta and over the
    result) and, across processes, all-reduce one float64 per variable; the updates themselves are not
    reduced a second time.

    Args:
        every: optimizer steps between two reports in the batch logs.

    Examples:
        >>> model.fit(x, y, callbacks=[tf_adasum.callbacks.OrthogonalityMonitor(every=100)])
    """

    serves_keras_2 = True  # tf_keras's syncs (training/keras2_sync.py) record the same statistics

    def __init__(self, every: int = 100) -> None:
        super().__init__()
        self.every = model_sync.check_positive_integer("every", every)
        self.history: list[tuple[int, dict[str, float]]] = []
        self._stats: Any = None
        self._optimizer: Any = None
        self._next = every

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        model = self.model
        comm = distributed.init()
        if comm.size > 1:
            # The recording adds a collective to every sync: a process without a monitor would not join
            # it. Meeting here first turns that into an error at train begin, naming the missing rank.
            agreement.gather_objects(
                comm, "monitor", "OrthogonalityMonitor start (add the monitor on every process)"
            )
        self._optimizer = _compat.loss_scale_inner(model.optimizer)
        with model.distribute_strategy.scope():
            self._stats = model_sync.SyncStats(list(model.trainable_variables))
        model_sync.enable_sync_stats(self._optimizer, self._stats)
        retrace_with(model)  # one traced before would not record
        self._next = (int(model.optimizer.iterations.numpy()) // self.every + 1) * self.every

    def values(self) -> dict[str, float]:
        """The orthogonality of each variable at the last sync, and their mean; empty before any sync."""
        if self._stats is None or int(self._stats.syncs.numpy()) == 0:
            return {}
        deltas = self._stats.deltas_sq.numpy()
        combined = self._stats.combined_sq.numpy()
        out = {}
        for name, d, c in zip(self._stats.names, deltas, combined, strict=True):
            if d > 0:  # a variable that did not move has no direction
                out[f"orthogonality/{name}"] = float(c / d)
        if out:
            out["orthogonality"] = float(np.mean(list(out.values())))
        return out

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        step = int(self.model.optimizer.iterations.numpy())
        if step < self._next:
            return
        self._next = (step // self.every + 1) * self.every  # steps_per_execution may jump past a multiple
        values = self.values()
        if values:
            self.history.append((step, values))
            if logs is not None:
                logs.update(values)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        values = self.values()
        if not values:
            warnings.warn(
                "OrthogonalityMonitor has seen no Adasum sync that moved a variable in this fit: train "
                "under AdasumStrategy, with AdasumOptimizer, or with AdasumCallback",
                stacklevel=2,
            )
        elif logs is not None:
            logs.update(values)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._optimizer is not None:
            model_sync.enable_sync_stats(self._optimizer, None)
            retrace_without(self.model)
            self._optimizer = None
