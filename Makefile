# Set-up is part of every target: a fresh clone needs only `make train` or `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch where the machine provides one; on a GPU machine pass TORCH=torch (CUDA build).
# Elsewhere on a CPU-only machine, point TORCH_INDEX at PyTorch's CPU wheel index to avoid CUDA wheels.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
# Azurite, Azure Blob Storage's emulator the object-storage tests start (distrain/testing/emulators.py), from npm
# into .npm/; without npm the set-up goes on and those tests fail, saying how to install it.
AZURITE_VERSION := 3.37.0
AZURITE := .npm/azurite-$(AZURITE_VERSION)

.PHONY: setup train test coverage bench gpu-check wheelhouse lint clean

setup: $(VENV)/.installed $(AZURITE)

$(AZURITE):
	@if command -v npm >/dev/null; then \
		npm install --prefix .npm --no-save --no-audit --no-fund --loglevel=error azurite@$(AZURITE_VERSION) && touch $@; \
	else echo "npm not found: the Azure object-storage tests will fail (install Node.js 20+ with npm, then make setup)" >&2; fi

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(PIP) -e ".[dev,hf,plot,tensorboard,s3]"
	touch $@

train: setup
	$(PY) jobs/train.py $(ARGS)

# Two streams side by side (tests/conftest.py:pytest_xdist_make_scheduler); STREAMS= runs the suite as one.
STREAMS ?= -n 2
test: setup
	$(PY) -m pytest -q $(STREAMS) $(ARGS)

# Line and branch coverage of distrain/ over the whole suite, Ray workers and spawned ranks included, and which
# checks fire (tests/checks.py rewrites tests/checks.txt); the report: docs/development.md#coverage.
COVERAGE_DIR := $(CURDIR)/.coverage-data
coverage: setup
	rm -rf $(COVERAGE_DIR) && mkdir -p $(COVERAGE_DIR)
	COVERAGE_FILE=$(COVERAGE_DIR)/data DISTRAIN_FIRED_REQUIRES=$(COVERAGE_DIR)/requires DISTRAIN_TIMEOUT_SCALE=2 \
		DISTRAIN_TEST_TIMES=$(COVERAGE_DIR)/times \
		PYTHONPATH=$(CURDIR)/tests/covhook$${PYTHONPATH:+:$$PYTHONPATH} \
		$(PY) -m coverage run -m pytest -q $(ARGS); echo $$? > $(COVERAGE_DIR)/pytest-status
	cd $(COVERAGE_DIR) && $(CURDIR)/$(PY) -m coverage combine -q --data-file=data
	$(PY) -m coverage report --data-file=$(COVERAGE_DIR)/data --precision=1 > $(COVERAGE_DIR)/report.txt
	grep TOTAL $(COVERAGE_DIR)/report.txt
	$(PY) tests/checks.py update $(if $(ARGS),--part) --coverage-file=$(COVERAGE_DIR)/data --requires=$(COVERAGE_DIR)/requires
	exit $$(cat $(COVERAGE_DIR)/pytest-status)

bench: setup
	$(PY) jobs/bench/bench_ddp.py $(ARGS)

# The GPU figures (strategies on NCCL, bf16 against fp32, the user's journey: kill, resume, export, generate;
# the parameter server, a sticky CUDA error) in one command, MFU and collectives with ARGS="--parts ..."; without
# a GPU, a check that the scripts work. On a GPU machine: make gpu-check TORCH=torch (see jobs/gpu_check.py).
gpu-check: setup
	$(PY) jobs/gpu_check.py $(ARGS)

# A folder of wheels that installs distrain, torch excepted, on a GPU node with no package index
# (docs/install.md): make wheelhouse PYTHON=3.12 PLATFORM=manylinux_2_28_x86_64 [EXTRAS=hf] [OUT=dir].
# PYTHON and PLATFORM default to this machine's, OUT to wheelhouse-cp312-manylinux_2_28_x86_64 (the target's
# name); set here, not from the environment (PYTHON is often a path).
PYTHON =
PLATFORM =
EXTRAS ?=
OUT ?=
wheelhouse: setup
	$(PY) jobs/wheelhouse.py $(if $(PYTHON),--python $(PYTHON)) $(if $(PLATFORM),--platform $(PLATFORM)) $(if $(EXTRAS),--extras $(EXTRAS)) $(if $(OUT),--out "$(OUT)")

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) runs outputs .npm
