# `make test` sets up .venv on a fresh machine (with the test and train extras: the suite runs a
# short demo and the TRL / verl integrations) and runs the suite with the Triton interpreter;
# `make check` (CI) runs all of it, the slow tests too, then a GPU machine's packages
# (`make gpu-env-check`) and a user's plain install (`make install-check`); `make demo` sets up
# .venv with the train extra only and runs the main job.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch's CPU build, from PyTorch's own index as its install instructions give it (a plain
# `pip install torch` on Linux takes the CUDA build, several GB), then its dependencies from
# PyPI. Override either, e.g. `make test TORCH=torch==2.11.0` or
# TORCH_INDEX=https://download.pytorch.org/whl/cu128.
TORCH ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# `$(call install_torch,python)`
install_torch = $(1) -m pip install --quiet --no-deps --index-url $(TORCH_INDEX) $(TORCH) && \
	$(1) -m pip install --quiet $(TORCH)

SHELL := bash
.SHELLFLAGS := -eo pipefail -c
# `$(call logged,command,log)`: the command's output into the log, its last line shown; on
# failure the log's end shown
logged = $(1) > $(2) 2>&1 || { tail -n 60 $(2); exit 1; }; tail -n 1 $(2)

.PHONY: setup test check demo gpu-env-check install-check clean

# The venv with torch (CPU build unless one is there) and the package with the train extra.
$(VENV)/.demo-installed: setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || { $(call install_torch,$(PY)); }
	$(PY) -m pip install --quiet -e ".[train]"
	touch $@

# ... and the test extra, with verl (--no-deps: its own pins clash with ours).
$(VENV)/.installed: $(VENV)/.demo-installed
	$(PY) -m pip install --quiet -e ".[test,train]"
	$(PY) -m pip install --quiet --no-deps verl==0.9.1
	touch $@

setup: $(VENV)/.installed

# RLFUSE_REQUIRE_INTEGRATIONS: the TRL and verl tests fail, not skip, if a package is missing.
# Two workers (pytest-xdist), each taking whole files; a progress line a minute (the files
# running, the slowest tests so far) and the slowest tests listed at the end.
# `make test` leaves out the few tests marked slow (minutes each); `make check` (CI) runs all.
PYTEST := TRITON_INTERPRET=1 RLFUSE_REQUIRE_INTEGRATIONS=1 $(PY) -m pytest -q -n 2 \
	--dist loadfile --durations=15 --progress=60

test: setup
	$(PYTEST) -m "not slow" tests

check: setup
	$(PYTEST) tests
	$(MAKE) gpu-env-check install-check

# A GPU machine's own Python, here on the CPU: its packages (GPU_PACKAGES; no pandas, no
# matplotlib) and the peers installed without their dependencies, as bench/README.md carries
# them. Every gpu-marked test collects, every kernel variant compiles for sm_90 with its triton,
# and the GPU check's dry run exits 0.
GPU_VENV := .venv-gpu
GPU_PACKAGES ?= triton==3.6.0 transformers==5.17.0 pytest pytest-xdist pytest-timeout \
	hypothesis numpy
GPU_WHEELS ?= trl==1.16.0 liger-kernel==0.8.5

$(GPU_VENV)/.installed: setup.py
	test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	$(call install_torch,$(GPU_VENV)/bin/python)
	$(GPU_VENV)/bin/python -m pip install --quiet $(GPU_PACKAGES)
	$(GPU_VENV)/bin/python -m pip install --quiet --no-deps $(GPU_WHEELS)
	touch $@

gpu-env-check: $(GPU_VENV)/.installed
	$(call logged,$(GPU_VENV)/bin/python -m pytest --collect-only -q -m gpu \
		-p no:cacheprovider tests,$(GPU_VENV)/collect.log)
	$(call logged,env -u TRITON_INTERPRET TRITON_CACHE_DIR=$$(mktemp -d) \
		$(GPU_VENV)/bin/python -m tools.gpu_compile --arch 90 --jobs 2,$(GPU_VENV)/compile.log)
	$(call logged,GPU_CHECK_CPU=1 PYTHON=$(GPU_VENV)/bin/python OUT=$$(mktemp -d) \
		bash bench/gpu_check.sh,$(GPU_VENV)/dry-run.log)

# A user's install: a fresh venv, torch's CPU build, `pip install .` alone, and a fused loss
# through the interpreter, run from outside the repository.
INSTALL_VENV := .venv-install

install-check:
	rm -rf $(INSTALL_VENV) && $(PYTHON) -m venv $(INSTALL_VENV)
	$(call install_torch,$(INSTALL_VENV)/bin/python)
	$(INSTALL_VENV)/bin/python -m pip install --quiet .
	cd $$(mktemp -d) && TRITON_INTERPRET=1 $(CURDIR)/$(INSTALL_VENV)/bin/python \
		$(CURDIR)/tools/install_check.py

clean:
	rm -rf $(VENV) $(GPU_VENV) $(INSTALL_VENV) build *.egg-info .pytest_cache

# `make demo`: a tiny transformers + peft LoRA policy trained by each loss, kernels interpreted.
demo: $(VENV)/.demo-installed
	TRITON_INTERPRET=1 $(PY) -m rlfuse.demo
