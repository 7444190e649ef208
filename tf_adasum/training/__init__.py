"""Where Adasum meets training: the model sync, the optimizers, the strategy, the state processes
share, each replica's optimizer state, loss scaling, and BatchNorm over processes."""
