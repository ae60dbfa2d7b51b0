# Set-up and entry points. Every target creates or reuses .venv with the pinned stack.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
EXTRAS := xla,jax,tpu-compile,triton,demo,bench,test,lint
export PJRT_DEVICE ?= CPU

.PHONY: venv lint test test-fast demo bench clean

# What the linters and the type checker read (README code blocks are run by tests/test_readme.py instead).
LINT_PATHS := revlib_xla tests bench kernels

$(VENV)/.installed: setup.cfg constraints.txt
	@command -v uv >/dev/null 2>&1 || $(PYTHON) -m pip install -q uv
	@test -x $(PY) || uv venv -q -p $(PYTHON) $(VENV)
	uv pip install -q -p $(PY) -c constraints.txt -e '.[$(EXTRAS)]'
	@touch $@

venv: $(VENV)/.installed

lint: venv
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

test: lint
	$(PY) -m pytest -n 2 --dist loadfile -q tests

test-fast: venv
	$(PY) -m pytest -q -x -m "not slow" tests

demo: venv
	$(PY) -m revlib_xla.demo

bench: venv
	$(PY) bench/reversible_vs_peers.py

clean:
	rm -rf $(VENV) build *.egg-info
