# The two commands of the README: `make demo` and `make test`. Both set themselves up first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The tested torch build, pinned here (the package itself asks only for a range) so that
# pip takes the CPU wheel on disk instead of resolving a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test bench clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/trainer fit recipes/digits.yaml recipes/digits_ddp.yaml

test: setup
	$(BIN)/pytest -q

bench: setup
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache
