# The two commands of README.md. Each sets up its own venv inside the repo on a fresh machine.
#   make demo   the main job (CPU is enough)
#   make test   the test suite (CI runs exactly this through .ci/run)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned in the same pip call so pip never resolves a second (multi-GB CUDA) torch build.
TORCH := torch==2.13.0

.PHONY: demo test lint clean

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH) -e .
	touch $@

$(VENV)/.dev: $(VENV)/.base pyproject.toml
	$(PY) -m pip install -q $(TORCH) -e ".[dev,gpu,hf]"
	touch $@

demo: $(VENV)/.base
	$(PY) recipes/demo.py

# pytest exits 5 when it collects nothing: any non-zero status fails make, so that fails too.
test: $(VENV)/.dev
	$(PY) -m ruff check .
	$(PY) -m pytest -m "not slow" -q

clean:
	rm -rf $(VENV)
