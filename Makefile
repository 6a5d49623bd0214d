# Two commands a newcomer needs: `make run` (the main job) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.installed-runtime
TESTING := $(VENV)/.installed-test

.PHONY: install run test test-all fuzz bench bench-ops lint docs clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is installed first and pinned so that no dependency range pulls a CUDA build.
# `make run` needs the runtime dependencies only; the test extras (llama.cpp, built from
# source the first time) are installed by the targets that need them.
$(RUNTIME): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "torch==2.13.0" || $(BIN)/pip install -q "torch>=2.5"
	$(BIN)/pip install -q -e .
	touch $@

# llama-cpp-python is built from source with -march=native; on machines with Intel AMX its AMX
# matmul kernels segfault in the first decode (ggml-org/llama.cpp#20824), so they are left out.
# No pip cache: a wheel cached from a build with them would be reused as is.
LLAMA_CPP_CMAKE_ARGS := -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8

$(TESTING): $(RUNTIME)
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(BIN)/pip install -q --no-cache-dir -e ".[test,dev]"
	touch $@

install: $(RUNTIME)

run: $(RUNTIME)
	$(BIN)/llamatrain fit --config shakespeare

test: $(TESTING)
	$(BIN)/python -m pytest -q

test-all: $(TESTING)
	$(BIN)/python -m pytest -q -m "slow or not slow"

# The fuzz targets of tests/fuzz with many random examples each (FUZZ_EXAMPLES, default 5000;
# `make test` runs the same targets derandomized with 40). Figures: README "Safety".
fuzz: $(TESTING)
	HYPOTHESIS_PROFILE=fuzz $(BIN)/python -m pytest -q -p no:cacheprovider -m fuzz tests/fuzz \
		--hypothesis-show-statistics

bench: $(RUNTIME)
	$(BIN)/python bench/train.py

bench-ops: $(RUNTIME)
	$(BIN)/python bench/ops.py

# The documentation site (mkdocs.yml, docs/): the generated references rewritten from the code,
# then a strict build into site/ (a broken link or a missing reference fails it). The example
# notebooks are executed in their seconds-long version and rendered with their outputs.
docs: $(TESTING)
	$(BIN)/python scripts/gen_config_reference.py
	$(BIN)/python scripts/gen_cli_reference.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: $(TESTING)
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/ruff format --check src tests bench scripts
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) runs site .pytest_cache
