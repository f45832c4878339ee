#!/usr/bin/env bash
# Installs what `make test` / `make demo` / `make bench` need, and nothing that is already there.
# torch: never replaced when present (the GPU machine brings its own CUDA build); when absent, the
# CPU build pinned here (an unpinned `torch` resolves to a multi-GB CUDA build).
set -euo pipefail
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
have() { "$PY" -c "import $1" >/dev/null 2>&1; }

have torch || pip_install "torch==2.13.0"
have triton || pip_install "triton==3.9.0"
missing=()
for mod_pkg in pytest:pytest xdist:pytest-xdist hypothesis:hypothesis \
               pytest_benchmark:pytest-benchmark numpy:numpy matplotlib:matplotlib; do
  have "${mod_pkg%%:*}" || missing+=("${mod_pkg#*:}")
done
[ ${#missing[@]} -eq 0 ] || pip_install "${missing[@]}"
"$PY" -c "import kvattn" >/dev/null 2>&1 || pip_install --no-deps --no-build-isolation -e .
