"""Shared pytest setup: quiet TensorFlow, and the eager / tf.function switch."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from collections.abc import Callable
from typing import Any

import pytest
import tensorflow as tf

from tests.support.scripts import three_processes  # noqa: F401 (a fixture: the 3-process scripts' runs)
from tests.support.users import shared  # noqa: F401 (a fixture: a folder another user can write in)

# Four logical CPUs, as MirroredStrategy-style tests use in place of GPUs. This must happen before
# TensorFlow creates its devices, so here, before any test module runs an op.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 4
)


# tryfirst: xdist's worker reads the xdist_group marks in its own pytest_collection_modifyitems, which
# pluggy calls before this file's (registered later, called first) unless this one asks to go first.
# Without it the marks arrived too late and both workers ran jobs of several processes at once.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test`'s -n), every test that launches a job runs on one worker, one at a
    time: two jobs of several processes at once on a 2-core machine would starve each other's timeouts.
    The release matrix goes to a group of its own, beside the in-process tests: its venvs install and
    test in one process each, and its one job is short."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.get_closest_marker("matrix"):
            item.add_marker(pytest.mark.xdist_group("matrix"))
        elif item.get_closest_marker("multiprocess"):
            item.add_marker(pytest.mark.xdist_group("processes"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """On an xdist worker under --dist loadgroup, fails a job's test whose group did not take: xdist reads
    the group from a suffix it writes into the node id, which pytest 9.2 ignores
    (pytest-dev/pytest-xdist#1386), and the jobs would then run two at a time with nothing said."""
    if not getattr(item.config.option, "loadgroup", False) or not item.get_closest_marker("multiprocess"):
        return
    if not item.nodeid.endswith(("@processes", "@matrix")):
        pytest.fail(
            f"--dist loadgroup did not group this test: expected its node id to end in @processes, got "
            f"{item.nodeid} (pytest {pytest.__version__}; 9.2 breaks xdist's groups: the Makefile pins it)"
        )


@pytest.fixture(params=["eager", "tf_function"])
def run(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """Calls a function eagerly or through a fresh tf.function, so each case checks both modes."""

    def call(fn: Callable[..., Any], *args: Any) -> Any:
        if request.param == "eager":
            return fn(*args)
        return tf.function(fn, autograph=False)(*args)

    return call
