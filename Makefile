# Set-up and entry points. Every target creates or reuses .venv with the pinned stack.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
EXTRAS := xla,jax,tpu-compile,triton,demo,bench,test,lint,docs
export PJRT_DEVICE ?= CPU

# The second environment: the newest torch (no torch_xla, no jax), the stack of the CUDA images and Colab's
# runtimes. A local wheel folder with torch's CPU build (as on this project's machines) avoids downloading the
# CUDA build's libraries; without it the index's build is installed.
NEWER_VENV ?= .venv-newer
NEWER_PY := $(NEWER_VENV)/bin/python
WHEELS ?= /opt/wheels
FIND_LINKS := $(if $(wildcard $(WHEELS)/*.whl),--find-links $(WHEELS))

# pytest on two workers, each taking whole files (the module-scoped fixtures are built once).
PYTEST_N := -m pytest -n 2 --dist loadfile -q

.PHONY: venv venv-newer docs lint strip-notebooks typecheck test test-all test-slow test-fast test-newer demo bench gpu-wheels gpu-check gpu-8b clean

# What the linters and the type checker read (README code blocks are run by tests/project/test_readme.py instead).
LINT_PATHS := revlib_xla tests bench kernels colab docs/_hooks

$(VENV)/.installed: setup.cfg constraints.txt
	@command -v uv >/dev/null 2>&1 || $(PYTHON) -m pip install -q uv
	@test -x $(PY) || uv venv -q -p $(PYTHON) $(VENV)
	uv pip install -q -p $(PY) -c constraints.txt -e '.[$(EXTRAS)]'
	@touch $@

$(NEWER_VENV)/.installed: setup.cfg constraints-newer.txt
	@command -v uv >/dev/null 2>&1 || $(PYTHON) -m pip install -q uv
	@test -x $(NEWER_PY) || uv venv -q -p $(PYTHON) $(NEWER_VENV)
	uv pip install -q -p $(NEWER_PY) $(FIND_LINKS) -c constraints-newer.txt -e '.[test]'
	@touch $@

venv: $(VENV)/.installed

venv-newer: $(NEWER_VENV)/.installed

# The notebooks are committed without outputs, execution counts or per-run metadata (papermill's, Colab's).
NOTEBOOKS := $(wildcard colab/*.ipynb)
NBSTRIPOUT := $(VENV)/bin/nbstripout --extra-keys "metadata.papermill cell.metadata.papermill cell.metadata.colab \
	cell.metadata.outputId cell.metadata.execution"

# ruff (lint and format) over the code, mypy over the library (configured in setup.cfg's [mypy]), and no notebook
# with outputs (`make strip-notebooks` removes them).
lint: typecheck docs
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(NBSTRIPOUT) --verify $(NOTEBOOKS)

# The documentation site (README.md as its home page, docs/*.md) into site/; --strict: a broken link or anchor
# between pages fails the build.
docs: venv
	$(VENV)/bin/mkdocs build --strict

strip-notebooks: venv
	$(NBSTRIPOUT) $(NOTEBOOKS)

typecheck: venv
	$(VENV)/bin/mypy

# CI's suite: every fast test and the slow tests listed in tests/ci_slow.txt (under 25 minutes with set-up on 2 cores).
test: lint
	$(PY) $(PYTEST_N) -m "not slow or ci" tests

# Every test (about an hour on 2 cores), and the slow ones alone.
test-all: lint
	$(PY) $(PYTEST_N) tests

test-slow: venv
	$(PY) $(PYTEST_N) -m slow tests

# Everything but the tests marked slow (setup.cfg registers the marker).
test-fast: venv
	$(PY) $(PYTEST_N) -m "not slow" tests

# The suite on the newer torch without the tests marked slow (the compatibility check; the slow end-to-end runs are
# in `make test`); what needs torch_xla, jax or libtpu skips with its reason.
test-newer: venv-newer
	$(NEWER_PY) $(PYTEST_N) -m "not slow" tests

# The user's first command: revlib-xla train on the cpu-smoke config (a falling loss in under 2 minutes on a 2-core
# CPU), then the memory table of one step against depth (eager and the deviceless TPU compile).
demo: venv
	$(VENV)/bin/revlib-xla train --config tpu_configs/cpu-smoke.yaml train.out_dir=runs/demo train.resume=false
	$(PY) -m revlib_xla.demo --no-train

bench: venv
	$(PY) bench/reversible_vs_peers.py

# A lent GPU (no package index there; see bench/README.md). `make gpu-wheels`, on a machine with an index, downloads
# into $(GPU_WHEELS) the wheels the GPU image lacks, for its Python (3.12, manylinux x86-64): pydantic (a core
# requirement) with its dependencies, and RevLib 1.7.2 for bench/reversible_vs_peers.py. Carry the folder along.
GPU_WHEELS ?= .gpu-wheels
GPU_PYTHON_VERSION ?= 3.12
GPU_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
GPU_DOWNLOAD = $(PYTHON) -m pip download -q --dest $(GPU_WHEELS) --only-binary=:all: \
	--python-version $(GPU_PYTHON_VERSION) --implementation cp \
	--abi cp$(subst .,,$(GPU_PYTHON_VERSION)) --abi abi3 --abi none $(addprefix --platform ,$(GPU_PLATFORMS) any)

gpu-wheels:
	rm -rf $(GPU_WHEELS)
	$(GPU_DOWNLOAD) -c constraints.txt 'pydantic>=2.5'
	$(GPU_DOWNLOAD) --no-deps revlib==1.7.2
	@ls $(GPU_WHEELS)

# `make gpu-check` on the GPU machine: installs from $(GPU_WHEELS) only (--no-index), then bench/gpu_check.py's four
# parts (~9 minutes) write bench/results/gpu_check-*-cuda-<device>.md; GPU_CHECK_PACK=$$OUT copies them and a
# .tar.gz of everything there. `make gpu-check GPU_CHECK_DRY=1`: the same command at toy sizes on the CPU (CI).
GPU_PYTHON ?= python3
GPU_CHECK_DRY ?=
GPU_CHECK_PACK ?=
GPU_CHECK_OUT ?= $(if $(filter 1,$(GPU_CHECK_DRY)),runs/gpu-check-dry/results,bench/results)

gpu-check: $(if $(filter 1,$(GPU_CHECK_DRY)),venv)
	$(if $(filter 1,$(GPU_CHECK_DRY)),$(PY) bench/gpu_check.py --dry,$(GPU_PYTHON) bench/gpu_check.py --wheels $(GPU_WHEELS)) \
		--out-dir $(GPU_CHECK_OUT) $(if $(GPU_CHECK_PACK),--pack $(GPU_CHECK_PACK))

# `make gpu-8b` on the GPU machine (after gpu-check, or with GPU_WHEELS for pydantic): llama-8b with
# gpu_configs/llama-8b-24gb.yaml under a 24 GiB limit (~3 minutes), bench/results/gpu_8b-cuda-<device>.md.
gpu-8b:
	$(GPU_PYTHON) bench/gpu_8b.py $(if $(wildcard $(GPU_WHEELS)),--wheels $(GPU_WHEELS)) --out-dir $(GPU_CHECK_OUT)

clean:
	rm -rf $(VENV) $(NEWER_VENV) build *.egg-info .gpu-site
