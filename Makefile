# loraplex: `make demo` runs the system, `make test` runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
ENGINE_STAMP := $(VENV)/.loraplex-engine
TEST_STAMP := $(VENV)/.loraplex-test

.PHONY: venv demo serve test test-fast screenshots lint typecheck bench

# `make venv` (tests, CI): the engine and test extras. The demo and serve need only the engine one
# and the openai client the demo's instructions use: 83 packages, 2.35 GB (most of it torch, and
# triton and transformers that xgrammar requires), against 143 and 2.63 GB with the test extra
# (PEFT, moto, selenium, pytest, ...); a later `make test` adds it to the same venv.
venv: $(TEST_STAMP)

# torch first: the CPU wheel then satisfies the engine extra's torch range (no CUDA torch is pulled).
$(ENGINE_STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@echo "==> installing torch 2.13.0 (CPU), loraplex with the engine extra and the openai client into $(VENV)"
	$(PIP) install --progress-bar on torch==2.13.0
	$(PIP) install --progress-bar on -e '.[engine]' 'openai>=1.40'
	@touch $(ENGINE_STAMP)

$(TEST_STAMP): $(ENGINE_STAMP) pyproject.toml
	@echo "==> installing loraplex's test extra into $(VENV)"
	$(PIP) install --progress-bar on -e '.[engine,test]'
	@touch $(TEST_STAMP)

demo: $(ENGINE_STAMP)  ## seed demo tenants + adapters, run gateway + one worker (embedded)
	$(VENV)/bin/loraplex demo

serve: $(ENGINE_STAMP)
	$(VENV)/bin/loraplex serve

# The fast tests in parallel, one process a core (each module has its own database and Redis
# prefix); the slow and end-to-end ones after them, one at a time: they start real processes
# and time them, and two at once would share the cores they measure.
test: venv  ## the whole suite, slow model-level and end-to-end tests included
	$(VENV)/bin/pytest -q -n auto -m "not slow and not e2e" --durations=10
	$(VENV)/bin/pytest -q -m "slow or e2e" --durations=25

test-fast: venv
	$(VENV)/bin/pytest -q -n auto -m "not slow and not e2e"

screenshots: venv  ## the console's screenshots in docs/console, made by its browser tests
	LORAPLEX_SCREENSHOTS=docs/console $(VENV)/bin/pytest -q tests/test_console_browser.py -k embedded

lint: venv typecheck
	$(VENV)/bin/ruff check .

# mypy over what pyproject.toml's [tool.mypy] lists: the torch-free packages and engine modules.
typecheck: venv
	$(VENV)/bin/mypy

bench: venv
	$(PY) bench/run_all.py
