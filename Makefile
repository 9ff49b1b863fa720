# The two entry points of the README: `make demo` (a real test run of an
# example step) and `make test`. Both install what they need themselves.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BASE_IMAGE ?=

.PHONY: demo demo-workflow test test-kubernetes venv engine images lint typecheck bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $@

venv: $(BIN)/.installed

engine:
	bash scripts/ensure-engine.sh

images: venv engine
	$(BIN)/sandbox images build $(if $(BASE_IMAGE),--base-image $(BASE_IMAGE))

demo: images
	$(BIN)/python examples/setup.py
	$(BIN)/python examples/job-board/demo.py bid-submit

# The job-board example's whole chain (pick -> submit -> outreach) as one test run.
demo-workflow: images
	$(BIN)/python examples/setup.py
	$(BIN)/python examples/job-board/demo_workflow.py

test: images lint
	$(BIN)/python examples/setup.py
	$(BIN)/python -m pytest -q -p no:cacheprovider

# The same run shape as Pods on a real local cluster (tests/kubernetes/README.md).
# The first run builds the Kubernetes binaries from Debian's source (minutes, cached
# in build/kubernetes/); the cluster lives only as long as the session.
test-kubernetes: images
	bash scripts/kubernetes-build.sh >/dev/null
	$(BIN)/python -m pytest -q -p no:cacheprovider -m kubernetes tests/kubernetes

lint: venv
	$(BIN)/ruff check sandbox bench tests examples
	$(BIN)/ruff format --check sandbox bench tests examples
	$(BIN)/mypy

bench: images
	$(BIN)/sandbox bench

clean:
	rm -rf build .pytest_cache .mypy_cache .ruff_cache
