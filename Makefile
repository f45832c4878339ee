PYTHON ?= python3
export PYTHON

.PHONY: deps build test demo env bench static static-env clean

deps:
	bash tools/ensure_deps.sh

# C++/CUDA extensions in place, incremental: the CPU-harness modules of the CUDA kernels always
# (g++ + pybind11), the CUDA module when nvcc is found (KVATTN_SKIP_CUDA_BUILD=1 skips it,
# KVATTN_CUDA_ARCHS=90 builds sm_90 only). The last line printed says what was skipped and why.
build: deps
	$(PYTHON) setup.py build_ext --inplace

# Without a GPU the Triton kernels run under the interpreter (tests/conftest.py). The slowest test
# (tests/test_install.py: `pip install .` into a fresh virtual environment) is marked slow:
# `$(PYTHON) -m pytest -n 2 -q -m "not slow" tests` leaves it out.
test: build static-env
	$(PYTHON) -m pytest -n 2 -q tests

# The static sm_90 figures (tools/static_sm90.py; NOT speed) are read with the Triton the H200
# image has, 3.6.0, in a venv beside the installed torch; without a registry the venv falls back to
# the installed Triton and tests/test_static_sm90.py says so. `make static` rewrites the committed
# table benchmarks/results/static_sm90.md (and .json), which the tests compare with a fresh one.
STATIC_VENV := build/venv-triton36
STATIC_PY := $(STATIC_VENV)/bin/python
static-env: $(STATIC_PY)

$(STATIC_PY):
	$(PYTHON) -m venv --system-site-packages $(STATIC_VENV)
	$(STATIC_PY) -m pip install -q --disable-pip-version-check triton==3.6.0 \
	  || echo "static-env: triton 3.6.0 not installed; the static figures use the installed Triton"

static: build static-env
	$(STATIC_PY) tools/static_sm90.py --markdown benchmarks/results/static_sm90.md \
	  --json benchmarks/results/static_sm90.json

demo: build
	$(PYTHON) -m kvattn.demo

env:
	$(PYTHON) -m kvattn.env

bench: build
	$(PYTHON) -m benchmarks.decode --quick && $(PYTHON) -m benchmarks.extend --quick

clean:
	rm -rf build dist *.egg-info .pytest_cache kvattn/backends/cuda/*.so kvattn/backends/cuda_sim/*.so \
	  kvattn/_build.json
