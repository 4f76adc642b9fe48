# Two commands set everything up on a fresh machine:
#   make demo   - the main job (creates .venv/ if missing)
#   make test   - the test suite (creates .venv/ if missing)
# PyTorch is pinned: on a machine without a GPU this takes the CPU wheel; never a bare `torch`.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.difftx-installed
TEST_STAMP := $(VENV)/.difftx-test-installed

.PHONY: demo test venv bench clean help

help:
	@echo "make demo   run the main job on the bundled data (sets up .venv/ first)"
	@echo "make test   run the test suite on CPU (sets up .venv/ first)"
	@echo "make bench  run the attention benchmark"

# the package with what the main job and the README examples need (plots, BPE tokenizers);
# the test tools (pytest, transformers, triton) only for `make test`
$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e ".[eval,data]"
	@touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[test]"
	@touch $(TEST_STAMP)

venv: $(TEST_STAMP)

# `difftx compare --preset cpu --seeds 8`: DIFF vs its matched baseline over 8 paired seeds, all evaluations,
# report in runs/demo/ (13-27 minutes from a fresh clone on 2 CPU cores, the venv included, depending on the CPU:
# docs/results.md; `.venv/bin/difftx demo` is the one-minute synthetic demo)
demo: $(STAMP)
	$(VENV)/bin/difftx compare --preset cpu --seeds 8 --out runs/demo
	@echo "report: runs/demo/report.md (plots in runs/demo/plots/)"

test: $(TEST_STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/attention.py

clean:
	rm -rf $(VENV) build *.egg-info
