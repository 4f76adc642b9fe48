# Two commands set everything up on a fresh machine:
#   make demo   - the main job (creates .venv/ if missing)
#   make test   - the test suite (creates .venv/ if missing)
#   make test-extras - the tests `make test` skips (optional integrations, torch.compile) in .venv-extras/
# PyTorch is pinned: on a machine without a GPU this takes the CPU wheel; never a bare `torch`.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.difftx-installed
TEST_STAMP := $(VENV)/.difftx-test-installed

.PHONY: demo test test-extras venv bench clean help

help:
	@echo "make demo   run the main job on the bundled data (sets up .venv/ first)"
	@echo "make test   run the test suite on CPU (sets up .venv/ first)"
	@echo "make test-extras  the tests make test skips: lm-evaluation-harness, TensorBoard, datasets, torch.compile"
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

# the suite in TEST_WORKERS processes (pytest-xdist), each test file in one of them (its fixtures built once);
# TEST_WORKERS=0 runs it in this one process
TEST_WORKERS ?= 2
test: $(TEST_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# `make test-extras`: the tests `make test` skips, each for its optional integration: lm-evaluation-harness
# (with accelerate), TensorBoard and datasets, each installed by name from PyPI, and torch.compile
# (DIFFTX_TEST_COMPILE=1: the trainer's --compile, every attention kind in one graph, the GPU suite's compiled step,
# every Triton kernel compiled offline for sm_90 and sm_80). They run in .venv-extras/, which sees .venv/'s packages (a .pth file: torch
# $(TORCH_VERSION) is never installed again, and pip may not replace it) and holds the extras, so `make test`'s own
# environment never changes. An integration whose packages pip cannot get is skipped with one line; a test
# skipped although its packages installed fails the target. About 4 minutes from nothing (pip downloads, a cold
# torch.compile cache), about 2 minutes once installed (2 CPU cores); .venv-extras/ takes about 0.7 GB.
EXTRAS_VENV := .venv-extras
EXTRAS_PY := $(EXTRAS_VENV)/bin/python
EXTRAS_STAMP := $(EXTRAS_VENV)/.difftx-sees-venv
EXTRAS_LMEVAL := lm-eval>=0.4.5,<0.5 accelerate>=1.0,<2
EXTRAS_TENSORBOARD := tensorboard>=2.14,<3
EXTRAS_DATASETS := datasets>=2.19,<6

$(EXTRAS_STAMP): $(TEST_STAMP)
	@test -x $(EXTRAS_PY) || $(PY) -m venv $(EXTRAS_VENV)
	@main=$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	  own=$$($(EXTRAS_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	  echo "import site; site.addsitedir('$$main')" > "$$own/difftx-sees-venv.pth"
	@$(EXTRAS_PY) -c "import torch, difftx; assert torch.__version__.split('+')[0] == '$(TORCH_VERSION)'"
	@touch $@

test-extras: $(EXTRAS_STAMP)
	@log=$(EXTRAS_VENV)/pip.log; : > $$log; tests=""; \
	part() { \
	  if $(EXTRAS_PY) -m pip install --quiet "torch==$(TORCH_VERSION)" $$2 >> $$log 2>&1; then tests="$$tests $$3"; \
	  else echo "make test-extras: $$1 skipped: pip could not install $$2 (see $$log)"; fi; \
	}; \
	part lm-evaluation-harness "$(EXTRAS_LMEVAL)" tests/test_interop_lm_eval.py::test_lm_eval_harness_offline_matches_difftx; \
	part TensorBoard "$(EXTRAS_TENSORBOARD)" tests/test_train_loop.py::test_tensorboard_logging_when_installed; \
	part datasets "$(EXTRAS_DATASETS)" tests/test_data.py::test_datasets_input_if_installed; \
	out=$(EXTRAS_VENV)/pytest.log; \
	{ DIFFTX_TEST_COMPILE=1 $(EXTRAS_PY) -m pytest -q $$tests tests/test_train_loop.py::test_compile_flag_trains tests/test_compile.py \
	  tests/test_gpu_suite.py::test_tiny_compiled_training tests/test_triton_kernel.py::test_kernels_compile_for_gpu_targets \
	  $(PYTEST_ARGS); echo $$? > $$out.rc; } | tee $$out; \
	rc=$$(cat $$out.rc); \
	if [ "$$rc" -eq 0 ] && grep -Eq "[0-9]+ skipped" $$out; then \
	  echo "make test-extras: a test skipped although its packages installed"; rc=1; fi; \
	exit $$rc

bench: $(STAMP)
	$(PY) benchmarks/attention.py

clean:
	rm -rf $(VENV) $(EXTRAS_VENV) build *.egg-info
