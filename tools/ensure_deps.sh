#!/usr/bin/env bash
# Installs what `make test` / `make demo` / `make bench` need, and nothing that is already there.
# torch: never replaced when present (the GPU machine brings its own CUDA build); when absent, the
# CPU build pinned here (an unpinned `torch` resolves to a multi-GB CUDA build).
# The editable install is pure Python (KVATTN_SKIP_EXTENSIONS=1); `make build` compiles the C++/CUDA
# extensions in place (pybind11 for the bindings, ninja for the nvcc build when present).
# --runtime: only what running kvattn needs (torch, triton, numpy for Triton's interpreter, and
# kvattn itself), for `make demo`.
set -euo pipefail
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
have() { "$PY" -c "import $1" >/dev/null 2>&1; }
install_kvattn() {
  "$PY" -c "import kvattn" >/dev/null 2>&1 || \
    KVATTN_SKIP_EXTENSIONS=1 pip_install --no-deps --no-build-isolation -e .
}

have torch || pip_install "torch==2.13.0"
have triton || pip_install "triton==3.9.0"
if [ "${1:-}" = --runtime ]; then
  have numpy || pip_install numpy
  install_kvattn
  exit 0
fi
missing=()
for mod_pkg in pytest:pytest xdist:pytest-xdist hypothesis:hypothesis \
               pytest_benchmark:pytest-benchmark numpy:numpy matplotlib:matplotlib pybind11:pybind11 \
               blake3:blake3; do
  have "${mod_pkg%%:*}" || missing+=("${mod_pkg#*:}")
done
command -v ninja >/dev/null 2>&1 || have ninja || missing+=("ninja")
[ ${#missing[@]} -eq 0 ] || pip_install "${missing[@]}"
# The transformers adapter is tested against one version; it does not touch torch. Without network
# (the GPU machine) the install fails and tests/integrations/transformers/test_transformers.py
# skips.
"$PY" -c "import sys, transformers; sys.exit(transformers.__version__ != '5.24.0')" >/dev/null 2>&1 \
  || pip_install "transformers==5.24.0" \
  || echo "ensure_deps: transformers 5.24.0 not installed; tests/integrations/transformers/test_transformers.py will skip"
install_kvattn
