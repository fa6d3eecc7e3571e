# Two commands for a newcomer:  `make demo` (the main job)  and  `make test`.
# Both create .venv on first use. torch is pinned to the CPU wheel (pyproject.toml).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint unit venv bench clean

$(BIN)/pagedkv: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(BIN)/pagedkv

venv: $(BIN)/pagedkv

demo: venv
	$(BIN)/pagedkv demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check cache_node/engine.py cache_node/attention.py cache_node/attention_kernel.py
	$(BIN)/mypy protos cache_node client coordinator pagedkv

test: lint
	$(BIN)/python -m pytest -q --timeout=300

clean:
	rm -rf $(VENV) build *.egg-info
