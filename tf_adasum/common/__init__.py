"""The bottom layer: errors, settings from the environment, Keras variables, the quiet start."""
