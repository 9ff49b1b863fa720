# The two entry points of the README: `make demo` (a real test run of an
# example step) and `make test`. Both install what they need themselves.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BASE_IMAGE ?=

.PHONY: demo demo-workflow test test-walls test-kubernetes venv engine images lint docs typecheck bench bench-load bench-kubernetes clean

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

# The job-board example's whole chain (pick -> submit -> outreach) as one test run, verified
# against its expect/chain.toml.
demo-workflow: images
	$(BIN)/python examples/setup.py
	$(BIN)/python examples/job-board/demo_workflow.py

# runsc too: one test reads its syscall table against the step's profile (no engine uses it here).
test: images lint
	bash scripts/ensure-chromium.sh
	bash scripts/ensure-runsc.sh >/dev/null
	$(BIN)/python examples/setup.py
	$(BIN)/python -m pytest -q -p no:cacheprovider

# The second walls (gVisor for the step, userns-remap) in second engines that the
# tests start and stop themselves (tests/engines/README.md); the host's engine is
# never reconfigured. Installs runsc (Debian package) when missing. The escape
# battery with the audit shapes (tests/security), egress, whole runs, the MCP
# servers (hostile stdio servers, real stdio and HTTP servers) and the job-board run,
# once per wall.
WALL_TESTS := tests/security tests/scenarios/test_egress_engine.py \
	tests/scenarios/test_run_engine.py tests/scenarios/test_mcp_isolation_engine.py \
	tests/scenarios/test_mcp_engine.py \
	tests/scenarios/test_guard_engine.py::test_job_board_steps_pass_and_change_nothing_outside
test-walls: images
	bash scripts/ensure-runsc.sh >/dev/null
	$(BIN)/python -m pytest -q -p no:cacheprovider -m second_engine tests/engines
	SANDBOX_TEST_WALL=userns $(BIN)/python -m pytest -q -p no:cacheprovider $(WALL_TESTS)
	SANDBOX_TEST_WALL=runsc $(BIN)/python -m pytest -q -p no:cacheprovider $(WALL_TESTS)

# The same run shape as Pods on a real local cluster (tests/kubernetes/README.md).
# The first run builds the Kubernetes binaries from Debian's source (minutes, cached
# in build/kubernetes/); the cluster lives only as long as the session.
test-kubernetes: images
	bash scripts/kubernetes-build.sh >/dev/null
	$(BIN)/python -m pytest -q -p no:cacheprovider -m kubernetes tests/kubernetes

# The docs site is built strictly here, so a broken link or a missing page fails
# `make test` (tests/repo/test_docs.py checks the generated references and the paths).
DOCS_PY := scripts/gen_docs.py docs/hooks/bench_tables.py
lint: venv
	$(BIN)/ruff check sandbox bench testbed tests examples $(DOCS_PY)
	$(BIN)/ruff format --check sandbox bench testbed tests examples $(DOCS_PY)
	$(BIN)/mypy
	$(BIN)/mypy $(DOCS_PY)
	$(MAKE) docs

# The docs site (docs/, mkdocs.yml) into build/site/.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

bench: images
	$(BIN)/sandbox bench

bench-load: images
	$(BIN)/sandbox bench --load

# A cluster's start-up figures (a run as a Pod, a run the scheduler places): the host
# config's cluster, else the local test cluster (testbed/kubernetes), started for the
# benchmark and stopped after it; the rows join bench/results.json.
bench-kubernetes: images
	$(BIN)/sandbox bench --only kubernetes

clean:
	rm -rf build .pytest_cache .mypy_cache .ruff_cache
