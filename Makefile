# torch_tpu: set-up, build, main job and tests.
#
#   make run    create .venv, install dependencies, build, run the main job
#   make test   same set-up, then every test: CTest (C++), pytest (Python) and
#               PyTorch's device-generic suites (tools/pytorch_suites.py, a
#               fixed fast subset of each file, cpu vs tpu)
#   make test-full  everything: the suites' every test (docs/pytorch_suites.md),
#               every OpInfo sample, the full distributed tier, tests marked
#               full_tier (TORCH_TPU_TEST_FULL=1)
#   make bench  same set-up, then every benchmarks/*.py
#   make clean  remove the build directory (make distclean: also .venv)
#
# The pip install of the dependencies sits behind a stamp file and reruns only
# when requirements.txt or pyproject.toml change; the package build (an
# incremental CMake build in build/py, through ccache) reruns every time, so
# C++ edits are always picked up.

SHELL := /bin/bash
.DEFAULT_GOAL := run

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Extra pip flags, e.g. PIP_FLAGS="--extra-index-url https://download.pytorch.org/whl/cpu"
PIP_FLAGS ?=
BUILD_DIR := build/py
DEPS_STAMP := $(VENV)/.deps-installed
# Arguments for the main job, e.g. make run ARGS="--steps 30"
ARGS ?=
# V=1 shows the CMake/compiler output of the package build.
V ?=
BUILD_VERBOSE := $(if $(filter 1,$(V)),-v,-q)

export CCACHE_DIR ?= $(HOME)/.cache/ccache
# Paths relative to the checkout in ccache keys: a fresh clone elsewhere (CI)
# reuses the objects compiled here.
export CCACHE_BASEDIR ?= $(CURDIR)
export CCACHE_NOHASHDIR ?= 1
# One compile job per core: torch headers make each compile heavy.
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc 2>/dev/null || echo 2)

APT_PACKAGES := ccache libgtest-dev ninja-build cmake g++

.PHONY: run test test-full test-cpp test-python test-suites bench setup sysdeps deps build clean distclean

run: build
	$(PY) examples/minilm_main.py $(ARGS)

# fast: a fixed 1/N of each PyTorch suite file (make test); full: all (make test-full).
SUITES ?= fast

# Every suite always runs; the target fails if any failed.
test: build
	@rc=0; \
	echo "== C++ tests (ctest) =="; \
	ctest --test-dir $(BUILD_DIR) --output-on-failure --no-tests=error || rc=1; \
	echo "== Python tests (pytest) =="; \
	$(PY) -m pytest -q tests/python || rc=1; \
	echo "== PyTorch's device-generic suites, cpu vs tpu ($(SUITES) subset) =="; \
	$(PY) tools/pytorch_suites.py --subset $(SUITES) || rc=1; \
	if [ $$rc -ne 0 ]; then echo "make test: FAILED (see above)"; fi; \
	exit $$rc

test-full:
	TORCH_TPU_TEST_FULL=1 TORCH_TPU_OPINFO_FULL=1 TORCH_TPU_DIST_FULL=1 $(MAKE) test SUITES=full

test-suites: build
	$(PY) tools/pytorch_suites.py --subset $(SUITES)

test-cpp: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure --no-tests=error

test-python: build
	$(PY) -m pytest -q tests/python

bench: build
	@shopt -s nullglob; files=(benchmarks/*.py); \
	if [ $${#files[@]} -eq 0 ]; then echo "no benchmarks yet"; exit 0; fi; \
	for f in "$${files[@]}"; do echo "== $$f =="; $(PY) "$$f" || exit 1; done

setup: sysdeps deps

# System tools: ccache, GoogleTest, ninja, cmake, a C++ compiler, and the venv
# module and headers of $(PYTHON). Installed with apt-get when one is missing
# and we are root; otherwise a warning.
sysdeps:
	@missing=""; \
	command -v ccache >/dev/null || missing="$$missing ccache"; \
	command -v ninja >/dev/null || missing="$$missing ninja"; \
	command -v cmake >/dev/null || missing="$$missing cmake"; \
	command -v c++ >/dev/null || missing="$$missing c++"; \
	if [ ! -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ] && \
	   [ ! -f /usr/include/gtest/gtest.h ]; then missing="$$missing gtest"; fi; \
	pkgs="$(APT_PACKAGES)"; \
	if ! $(PYTHON) -c 'import venv, ensurepip' 2>/dev/null; then \
	  missing="$$missing python3-venv"; pkgs="$$pkgs python3-venv"; fi; \
	if ! $(PYTHON) -c 'import os, sys, sysconfig; \
	  sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then \
	  missing="$$missing python3-dev"; pkgs="$$pkgs python3-dev"; fi; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing system packages (missing:$$missing)"; \
	    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y $$pkgs; \
	  else \
	    echo "warning: missing$$missing; install: sudo apt-get install -y $$pkgs" >&2; \
	  fi; \
	fi

$(PY):
	$(PYTHON) -m venv $(VENV)

# One pip command for everything, so torch stays at the pinned release.
$(DEPS_STAMP): $(PY) requirements.txt pyproject.toml
	$(PIP) install $(PIP_FLAGS) -r requirements.txt
	@$(PY) -c 'import importlib.metadata as m, sys; v = m.version("torch"); \
	  sys.exit(0 if v.split("+")[0] == "2.13.0" else f"torch {v} installed, 2.13.0 expected")'
	@touch $@

deps: $(DEPS_STAMP)

# Editable install through scikit-build-core; build/py persists, so this is an
# incremental CMake build (ccache is picked up by CMakeLists.txt). Backend
# autoload is off while building: CMake runs `import torch`, which would
# otherwise import the installed (possibly stale or half-built) torch_tpu.
build: sysdeps $(DEPS_STAMP)
	@echo "building torch_tpu in $(BUILD_DIR) (incremental; V=1 shows the compiler output)"
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(PIP) install $(PIP_FLAGS) $(BUILD_VERBOSE) --no-build-isolation -e .

clean:
	rm -rf build .pytest_cache *.egg-info

distclean: clean
	rm -rf $(VENV)

# Serving (vLLM on tpu, docs/serving.md): vLLM's runtime dependencies, pinned
# and constrained by requirements.txt so torch and transformers stay put, then
# vLLM itself with --no-deps (its wheel pins transformers<5.20). Behind its own
# stamp; an extra prerequisite of build, so run/test/bench all have it.
SERVING_STAMP := $(VENV)/.serving-installed
$(SERVING_STAMP): $(DEPS_STAMP) requirements-serving.txt requirements-vllm.txt
	$(PIP) install $(PIP_FLAGS) -c requirements.txt -r requirements-serving.txt
	$(PIP) install $(PIP_FLAGS) --no-deps -r requirements-vllm.txt
	@$(PY) -c 'import importlib.metadata as m, sys; \
	  t, h = m.version("torch"), m.version("transformers"); \
	  sys.exit(0 if (t.split("+")[0], h) == ("2.13.0", "5.24.0") else \
	    f"serving deps moved torch {t} / transformers {h}")'
	@touch $@
build: $(SERVING_STAMP)
