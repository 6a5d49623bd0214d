# Two commands a newcomer needs: `make run` (the main job) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test test-all bench bench-ops lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is installed first and pinned so that no dependency range pulls a CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "torch==2.13.0" || $(BIN)/pip install -q "torch>=2.4"
	$(BIN)/pip install -q -e ".[test,dev]"
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/llamatrain fit --config configs/shakespeare.toml

test: install
	$(BIN)/python -m pytest -q

test-all: install
	$(BIN)/python -m pytest -q -m "slow or not slow"

bench: install
	$(BIN)/python bench/train.py

bench-ops: install
	$(BIN)/python bench/ops.py

lint: install
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/ruff format --check src tests bench scripts

clean:
	rm -rf $(VENV) runs .pytest_cache
