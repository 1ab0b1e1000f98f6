# Set-up and entry points. `make demo` and `make test` work on a fresh machine:
# they create .venv, install torch (CPU build by default) and scirl, then run.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel. On a GPU machine install the torch your vLLM needs instead,
# e.g. `make TORCH_SPEC=torch==2.14.0 EXTRAS=test,gpu setup`.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

$(BIN)/scirl: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(BIN)/scirl

setup: $(BIN)/scirl

demo: setup
	$(BIN)/scirl demo

test: setup
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) outputs .pytest_cache
