PYTHON ?= python3
export PYTHON

.PHONY: deps build test demo bench clean

deps:
	bash tools/ensure_deps.sh

# C++/CUDA extensions in place, incremental: the CPU-harness modules of the CUDA kernels always
# (g++ + pybind11), the CUDA module when nvcc is found (KVATTN_SKIP_CUDA_BUILD=1 skips it).
build: deps
	$(PYTHON) setup.py build_ext --inplace

# Without a GPU the Triton kernels run under the interpreter (tests/conftest.py).
test: build
	$(PYTHON) -m pytest -n 2 -q tests

demo: build
	$(PYTHON) -m kvattn.demo

bench: build
	$(PYTHON) -m benchmarks.decode --quick && $(PYTHON) -m benchmarks.extend --quick

clean:
	rm -rf build *.egg-info .pytest_cache kvattn/backends/cuda/*.so kvattn/backends/cuda_sim/*.so
