# Two commands a new user needs: `make demo` and `make test`. Both create .venv on first use.
# `make test-fast` is the quick lane while working: tests/unit/ only, which starts no process, server or socket.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# Installed first so the project's torch range adds nothing; CPU-only laptops may prefer
# TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu".
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# pytest-xdist workers of `make test` (whole files to a worker: a file's servers and fixtures stay in one
# process) and of `make test-fast`. A worker that dies fails the run at once instead of being replaced
# (--max-worker-restart=0): a replaced worker can leave the run waiting forever. TEST_JOBS=0: one process.
FAST_JOBS ?= 2
TEST_JOBS ?= 2

.PHONY: demo test test-fast lint venv clean gpu-wheels

# pip's own notices go to a log, shown only if the install fails.
$(BIN)/.installed: pyproject.toml
	@echo "installing into $(VENV) (log: $(VENV)/install.log)"
	$(PYTHON) -m venv $(VENV)
	@{ $(BIN)/pip install --upgrade pip && $(BIN)/pip install $(TORCH_SPEC) && \
	  $(BIN)/pip install -e '.[test]'; } > $(VENV)/install.log 2>&1 || { tail -n 40 $(VENV)/install.log; exit 1; }
	touch $@

venv: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/intellect demo --config configs/demo.toml

# The linter and the type checker (both configured in pyproject.toml) run before the tests, so CI runs them.
lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/pyright

test: lint
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile --max-worker-restart=0 $(PYTEST_ARGS)

# No lint here, to keep the lane quick: `make lint` or `make test` runs it.
test-fast: $(BIN)/.installed
	$(BIN)/python -m pytest tests/unit -q -n $(FAST_JOBS) --max-worker-restart=0 $(PYTEST_ARGS)

# The lent GPU machine's missing packages as wheels in .whl/ (docs/deploy.md, "The GPU check").
gpu-wheels:
	bash benchmarks/gpu_wheels.sh

clean:
	rm -rf $(VENV) runs .pytest_cache
