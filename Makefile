# Two commands for a newcomer on a fresh machine:
#   make quickstart   set everything up (venv, pinned packages, extension) and run the quick start
#   make test         set everything up and run the tests
PYTHON ?= python3.11
VENV   := .venv
VPY    := $(VENV)/bin/python
DEPS   := $(VENV)/.deps-installed

.PHONY: quickstart test build bench clean

quickstart: build
	$(VPY) quickstart.py

test: build
	$(VENV)/bin/ruff check gear_torchrl tests benchmarks scripts tutorials quickstart.py
	$(VENV)/bin/ruff format --check gear_torchrl tests benchmarks scripts tutorials quickstart.py
	$(VENV)/bin/mypy
	$(VPY) -m pytest -q tests

bench: build
	$(VPY) benchmarks/storage_sampling.py --out bench_out/storage_sampling.json

$(VPY):
	$(PYTHON) -m venv $(VENV)

$(DEPS): requirements.txt | $(VPY)
	$(VPY) -m pip install --upgrade pip
	$(VPY) -m pip install --no-cache-dir -r requirements.txt
	touch $@

# Incremental: CMake reuses build/<wheel tag>. The CUDA part is built when torch is a
# CUDA build and nvcc is found (GEAR_TORCHRL_CUDA=ON|OFF overrides).
build: $(DEPS)
	CUDA_HOME=$${CUDA_HOME:-/usr/local/cuda} $(VPY) -m pip install --no-build-isolation --no-deps -e .

clean:
	rm -rf build $(VENV) bench_out
