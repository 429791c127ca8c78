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

# What the GPU image (Python 3.12, torch, CuPy, transformers) lacks, into .gpu_deps/ for the GPU machine
# (bench/device_run.sh): peft and accelerate (test oracles) and py3langid from the venv (pure Python), and
# sentencex built for Python 3.12 (it has a compiled module)
gpu-deps: $(STAMP)
	rm -rf .gpu_deps && mkdir -p .gpu_deps/wheels
	cp -r $(VENV)/lib/python3*/site-packages/peft $(VENV)/lib/python3*/site-packages/accelerate \
		$(VENV)/lib/python3*/site-packages/py3langid .gpu_deps/
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux2014_x86_64 "sentencex==$$($(PY) -c 'import importlib.metadata as m; print(m.version("sentencex"))')" \
		-d .gpu_deps/wheels
	cd .gpu_deps && unzip -q wheels/sentencex-*.whl 'sentencex/*' && rm -rf wheels
