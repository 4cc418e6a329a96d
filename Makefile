# One command each: `make demo` and `make test` set everything up in .venv, then run.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch lies on this machine's disk; pinning it keeps pip from resolving a
# multi-GB CUDA build. On a GPU machine: make TORCH=torch==<cuda build> ...
TORCH  ?= torch==2.13.0

.PHONY: install demo test test-fast docs clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

demo: install
	$(BIN)/weightsync demo

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

docs: install
	$(BIN)/weightsync config --docs --lang en > docs/configuration.md
	$(BIN)/weightsync config --docs --lang zh > docs/configuration.zh.md

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
