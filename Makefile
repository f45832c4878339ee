PYTHON ?= python3
export PYTHON

.PHONY: deps build test sanitize demo env bench static static-env clean

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

# The CPU harness built with AddressSanitizer and UBSan into build/sanitize/ (the normal modules
# are untouched), standing in for kvattn.backends.cuda_sim._sim (tests/conftest.py) while the
# harness tests and the cuda_sim cases of the hardening, fuzz and trace suites run. Python is not
# instrumented: the ASan runtime is preloaded (with libstdc++, whose __cxa_throw ASan intercepts
# and must find at start-up), and allocation reports from uninstrumented libraries (leaks,
# mismatched new/delete in torch) are off. SANITIZE_TESTS / SANITIZE_SELECT narrow it.
SANITIZE_DIR := build/sanitize
SANITIZE_FLAGS := -std=c++17 -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined \
  -fno-sanitize-recover=all -fno-strict-aliasing -Wno-unknown-pragmas -fvisibility=hidden -fPIC -shared
SANITIZE_TESTS ?= tests/test_sanitize.py tests/test_cuda.py tests/test_cuda_extend.py \
  tests/test_hardening.py tests/test_fuzz.py tests/test_traces.py
SANITIZE_SELECT ?= cuda_sim or test_cuda or sanitize
CXX ?= g++

$(SANITIZE_DIR)/_sim.so: $(shell find csrc -name '*.h' -o -name '*.cuh' -o -name '*.cpp') kvattn/tags.py
	mkdir -p $(SANITIZE_DIR)
	$(CXX) $(SANITIZE_FLAGS) -Icsrc -Ibuild/generated \
	  -I"$$($(PYTHON) -c 'import pybind11; print(pybind11.get_include())')" \
	  -I"$$($(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
	  csrc/sim/module_sim.cpp -o $@

sanitize: build $(SANITIZE_DIR)/_sim.so
	LD_PRELOAD="$$($(CXX) -print-file-name=libasan.so):$$($(CXX) -print-file-name=libstdc++.so)" \
	  ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0:new_delete_type_mismatch=0:detect_odr_violation=0 \
	  UBSAN_OPTIONS=print_stacktrace=1 KVATTN_SIM_MODULE=$(SANITIZE_DIR)/_sim.so \
	  $(PYTHON) -m pytest -n 2 -q -p no:cacheprovider -k "$(SANITIZE_SELECT)" $(SANITIZE_TESTS)

demo: build
	$(PYTHON) -m kvattn.demo

env:
	$(PYTHON) -m kvattn.env

bench: build
	$(PYTHON) -m benchmarks.decode --quick && $(PYTHON) -m benchmarks.extend --quick && $(PYTHON) -m benchmarks.mla --quick

clean:
	rm -rf build dist *.egg-info .pytest_cache kvattn/backends/cuda/*.so kvattn/backends/cuda_sim/*.so \
	  kvattn/_build.json
