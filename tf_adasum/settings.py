"""tf_adasum's settings from the environment, each read in one place: the peer timeout. No TensorFlow
and nothing of tf_adasum here, so that every layer, the launcher's included, may read them."""

from __future__ import annotations

import os

# How long any wait for a peer may last, unless $TF_ADASUM_TIMEOUT_SECONDS says otherwise.
DEFAULT_TIMEOUT_SECONDS = 300.0


def peer_timeout_seconds() -> float:
    """How long any wait for a peer may last: $TF_ADASUM_TIMEOUT_SECONDS, default 300 s."""
    return float(os.environ.get("TF_ADASUM_TIMEOUT_SECONDS", DEFAULT_TIMEOUT_SECONDS))
