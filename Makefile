# xscale: `make demo` and `make test` work on a fresh machine; both run `setup` first.
SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.xscale-installed
BUILD   := build
SHELL_SOURCES = $(shell git ls-files 'runscripts/*' 'jobs/*' 'containers/*' 'tests/*.sh' 'tests/**/*.sh' 'tests/shim/*' '.ci/run' | \
                  while read -r f; do head -c 100 "$$f" | grep -qE '^(\#!.*(ba)?sh|\# shellcheck shell=bash)' && echo "$$f"; done)
# Python programs without a .py name (jobs/lib/stage, stage-node): ruff reads them when named.
PYTHON_SCRIPTS = $(shell git ls-files 'runscripts/*' 'jobs/*' 'tests/*' | grep -v '\.' | \
                  while read -r f; do head -c 100 "$$f" | grep -qE '^\#!.*python' && echo "$$f"; done)

.PHONY: help setup system-packages venv test lint unit demo bench gpu-check sif cluster-up \
        cluster-down settings-doc clean

help:
	@echo "make demo          set up, start the virtual cluster, train MNIST on 2 nodes x 2 ranks"
	@echo "make test          set up, lint, unit tests, end-to-end tests on the virtual cluster"
	@echo "make bench         run.sh and get-master overheads, trainer throughput on CPU"
	@echo "make gpu-check     prove this node's GPUs: every trainer, the doctor, a profile,"
	@echo "                   throughput and MFU (one line and exit 0 without a GPU)"
	@echo "make sif           build the container image (needs singularity or apptainer)"
	@echo "make settings-doc  write docs/SETTINGS.md from the table in python/xscale/shared/settings.py"
	@echo "make setup | lint | unit | cluster-up | cluster-down | clean"

setup: system-packages venv

system-packages:
	@bash tests/cluster/install-system-packages.sh

venv: $(STAMP)

# Re-installs only when a requirements or constraints file or pyproject.toml changes (the stamp is
# newer otherwise). xscale itself is installed editable, as a user of a checkout would, so that
# the tests import the package (and run the `xscale` command) the way users get it.
$(STAMP): requirements.txt requirements-deepspeed.txt constraints.txt pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-build-isolation -r requirements-deepspeed.txt
	$(PY) -m pip install -q -c constraints.txt -e .
	@touch $@

lint: setup
	shellcheck $(SHELL_SOURCES)
	$(VENV)/bin/ruff check python tests runscripts jobs $(PYTHON_SCRIPTS)

# One pytest run for everything (the bats suites run from tests/test_bats.py), so CI reads one
# closing line. Three workers: the cluster tests in one, in order (tests/conftest.py groups them),
# the host-only tests in the other two, niced; they use the CPU the cluster tests leave idle while
# they wait for Slurm, timeouts and faults, on both cores (docs/TESTBED.md, "What a test costs here").
test: lint
	$(PY) -m pytest -q -n 3 --dist loadgroup --durations=15 tests

unit: setup
	$(PY) -m pytest -q tests -m "not cluster"

cluster-up: setup
	@bash tests/cluster/cluster-up.sh

cluster-down:
	@bash tests/cluster/cluster-down.sh

demo: setup cluster-up
	@bash jobs/local/demo.sh

bench: setup cluster-up
	@bash tests/bench/run-all.sh

# Not part of `test` (CI has no GPU): every GPU path on this node's GPUs, one table at the end,
# the same as JSON in build/gpu-check/ (docs/GPU-CHECK.md). Without a GPU: one line, exit 0.
# GPU_CHECK_ARGS adds options, e.g. "--examples ~/src/pytorch-examples" (tests/gpu/gpu_check.py
# --help).
gpu-check: setup
	@$(PY) tests/gpu/gpu_check.py $(GPU_CHECK_ARGS)

# Not part of setup: image builds need Singularity/Apptainer (a LUMI login node); build.sh says so
# in one line when neither is there.
sif:
	@bash containers/build.sh

# docs/SETTINGS.md is printed from the settings table; tests/test_settings.py fails until it is
# regenerated after a change. Written whole or not at all (a failed run leaves the old page).
settings-doc: venv
	$(PY) -m xscale settings --markdown > docs/SETTINGS.md.new
	mv docs/SETTINGS.md.new docs/SETTINGS.md

clean:
	rm -rf $(BUILD) .pytest_cache .ruff_cache
