# `make test` and `make serve` work on a fresh machine: they create .venv and
# install the pinned project into it first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-fast serve bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and alone: the exact pin takes the CPU build on our machines.
	$(BIN)/pip install "torch==2.13.0"
	$(BIN)/pip install -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

serve: $(STAMP)
	$(BIN)/tandem serve configs/local.yaml

bench: $(STAMP)
	$(BIN)/tandem bench offline --json bench-offline.json

clean:
	rm -rf $(VENV)
