PYTHON ?= python3
export PYTHON

.PHONY: deps build test demo env bench clean

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
test: build
	$(PYTHON) -m pytest -n 2 -q tests

demo: build
	$(PYTHON) -m kvattn.demo

env:
	$(PYTHON) -m kvattn.env

bench: build
	$(PYTHON) -m benchmarks.decode --quick && $(PYTHON) -m benchmarks.extend --quick

clean:
	rm -rf build dist *.egg-info .pytest_cache kvattn/backends/cuda/*.so kvattn/backends/cuda_sim/*.so \
	  kvattn/_build.json
