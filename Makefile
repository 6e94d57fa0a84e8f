# `make test` sets up .venv on a fresh machine (with the test and train extras: the suite runs a
# short demo and the TRL / verl integrations) and runs the suite with the Triton interpreter;
# `make demo` sets up .venv with the train extra only and runs the main job.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch (a plain `pip install torch` would fetch a multi-GB CUDA build).
TORCH_CPU ?= torch==2.13.0

.PHONY: setup test check demo clean

# The venv with torch (CPU build unless one is there) and the package with the train extra.
$(VENV)/.demo-installed: setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH_CPU)
	$(PY) -m pip install --quiet -e ".[train]"
	touch $@

# ... and the test extra, with verl (--no-deps: its own pins clash with ours).
$(VENV)/.installed: $(VENV)/.demo-installed
	$(PY) -m pip install --quiet -e ".[test,train]"
	$(PY) -m pip install --quiet --no-deps verl==0.9.1
	touch $@

setup: $(VENV)/.installed

# RLFUSE_REQUIRE_INTEGRATIONS: the TRL and verl tests fail, not skip, if a package is missing.
# Two workers (pytest-xdist), each taking whole files; the slowest tests listed at the end.
# `make test` leaves out the few tests marked slow (minutes each); `make check` (CI) runs all.
PYTEST := TRITON_INTERPRET=1 RLFUSE_REQUIRE_INTEGRATIONS=1 $(PY) -m pytest -q -n 2 \
	--dist loadfile --durations=15

test: setup
	$(PYTEST) -m "not slow" tests

check: setup
	$(PYTEST) tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# `make demo`: a tiny transformers + peft LoRA policy trained by each loss, kernels interpreted.
demo: $(VENV)/.demo-installed
	TRITON_INTERPRET=1 $(PY) -m rlfuse.demo
