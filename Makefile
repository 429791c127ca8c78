# The two fresh-machine commands (README): `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install gpu-deps

install: $(STAMP)

# torch first, pinned: pip takes the CPU build from local disk; a looser pin would pull a CUDA build.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/nllb-worker demo

test: $(STAMP)
	$(PY) -m pytest -q

# peft and accelerate (pure Python) from the venv into .gpu_deps/, for the GPU machine (bench/device_run.sh)
gpu-deps: $(STAMP)
	rm -rf .gpu_deps && mkdir -p .gpu_deps
	cp -r $(VENV)/lib/python3*/site-packages/peft $(VENV)/lib/python3*/site-packages/accelerate .gpu_deps/
