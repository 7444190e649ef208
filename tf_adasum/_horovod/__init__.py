"""Horovod's TensorFlow API on tf_adasum, in Horovod's own file names (its public faces are
tf_adasum/tensorflow.py and tf_adasum/keras.py)."""
