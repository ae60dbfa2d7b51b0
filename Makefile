# Set-up and entry points. Every target creates or reuses .venv with the pinned stack.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
EXTRAS := xla,jax,tpu-compile,triton,demo,bench,test
export PJRT_DEVICE ?= CPU

.PHONY: venv test test-fast demo bench clean

$(VENV)/.installed: setup.cfg constraints.txt
	@command -v uv >/dev/null 2>&1 || $(PYTHON) -m pip install -q uv
	@test -x $(PY) || uv venv -q -p $(PYTHON) $(VENV)
	uv pip install -q -p $(PY) -c constraints.txt -e '.[$(EXTRAS)]'
	@touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -n 2 --dist loadfile -q tests

test-fast: venv
	$(PY) -m pytest -q -x -m "not slow" tests

demo: venv
	$(PY) -m revlib_xla.demo

bench: venv
	$(PY) bench/reversible_vs_peers.py

clean:
	rm -rf $(VENV) build *.egg-info
