# The two commands of the README: `make demo` and `make test`. Both set themselves up first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The tested torch build, pinned here (the package itself asks only for a range) so that
# pip takes the CPU wheel on disk instead of resolving a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

# Tests marked slow start processes (ddp, ps, pipeline, torchrun, faults) and run one at a time: two of
# them at once would put 4+ processes on the 2 cores of a small machine and risk their timeouts.
# The in-process tests are independent (each runs in its own folder) and share the cores on 2 workers, with
# the slow tests marked one_core (one busy process at a time: a command, a docs block); worksteal evens out
# their unequal lengths between the workers.
WORKERS ?= 2

.PHONY: setup demo test test-fast bench device-wheels clean

# One venv for both commands, with a stamp per set of extras: `make demo` installs the core dependencies and
# scikit-learn (the `recipes` extra, the digits data) and nothing else; `make test` adds the `dev` extras (pytest,
# ray, mlflow, tensorboard, ...) to the same venv, also after a demo, since its own stamp is missing then.
# pip byte-compiles what it installs on one core; compileall does the same on every core (77 against 104 s for torch
# and the dev extras on 2 cores). Its exit status is ignored as pip ignores the same errors: a few packages ship
# files for other Python versions.
INSTALL := $(BIN)/pip install -q --no-compile
COMPILE := $(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null 2>&1 || true

$(BIN)/.venv-base: Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(INSTALL) "$(TORCH_PIN)"
	$(COMPILE)
	touch $@

$(BIN)/.installed-demo: $(BIN)/.venv-base pyproject.toml
	$(INSTALL) -e ".[recipes]"
	$(COMPILE)
	touch $@

$(BIN)/.installed-dev: $(BIN)/.venv-base pyproject.toml
	$(INSTALL) -e ".[dev]"
	$(COMPILE)
	touch $@

setup: $(BIN)/.installed-dev

demo: $(BIN)/.installed-demo
	$(BIN)/trainer fit recipes/digits.yaml recipes/digits_ddp.yaml
	@echo
	@echo "The trainer command lives in $(BIN)/: run '. $(BIN)/activate' to put it on PATH in this shell,"
	@echo "then try 'trainer --help' (or call $(BIN)/trainer directly)."

# The whole suite: the in-process and one-core tests on $(WORKERS) workers, then the multi-process ones one at a time.
test: $(BIN)/.installed-dev
	$(BIN)/pytest -q -m "not slow or one_core" -n $(WORKERS) --dist worksteal; fast=$$?; \
	$(BIN)/pytest -q -m "slow and not one_core"; slow=$$?; exit $$(( fast || slow ))

# The developer loop: everything but the slow tests (about a minute on 2 cores).
test-fast: setup
	$(BIN)/pytest -q -m "not slow" -n $(WORKERS)

bench: setup
	$(BIN)/python benchmarks/overhead.py

# What benchmarks/device_checks.sh needs on a lent GPU machine beyond its image (torch, pytest, rich, ...): omegaconf.
device-wheels: setup
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 -d .whl "omegaconf==$$($(BIN)/python -c 'import omegaconf; print(omegaconf.__version__)')"

clean:
	rm -rf $(VENV) runs .pytest_cache
