PYTHON ?= python3
export PYTHON

.PHONY: deps test demo bench clean

deps:
	bash tools/ensure_deps.sh

# On a machine without a GPU the Triton kernels run under the interpreter (tests/conftest.py).
test: deps
	$(PYTHON) -m pytest -n 2 -q tests

demo: deps
	$(PYTHON) -m kvattn.demo

bench: deps
	$(PYTHON) -m benchmarks.decode --quick

clean:
	rm -rf build *.egg-info .pytest_cache
