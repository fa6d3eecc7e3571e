# Two commands for a newcomer:  `make demo` (the main job)  and  `make test`.
# Both create .venv on first use. torch is pinned to the CPU wheel by constraints.txt
# (pyproject.toml itself declares ranges, so pagedkv installs beside vLLM or SGLang).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP_INSTALL := $(BIN)/pip install -q -c constraints.txt

.PHONY: demo test lint unit venv bench docs wheel clean

$(BIN)/pagedkv: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(PIP_INSTALL) -e '.[dev]'
	touch $(BIN)/pagedkv

venv: $(BIN)/pagedkv

demo: venv
	$(BIN)/pagedkv demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy protos cache_node client coordinator pagedkv

test: lint
	$(BIN)/python -m pytest -q --timeout=300

# The API reference from the docstrings, as HTML in build/api (not committed). Imports run
# for real (PDOC_ALLOW_EXEC): the native key chain compiles on import, and a suppressed
# compile would leave an empty library in the kernel cache.
docs: venv
	$(BIN)/python -c "import pdoc" 2>/dev/null || $(PIP_INSTALL) 'pdoc>=14'
	PDOC_ALLOW_EXEC=1 $(BIN)/pdoc --docformat markdown --no-show-source -o build/api pagedkv pagedkv.client pagedkv.cache_node pagedkv.coordinator pagedkv.protos '!pagedkv.protos.pagedkv_pb2.*'

# The wheel a user would install (dist/), built without network access.
wheel: venv
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w dist .

clean:
	rm -rf $(VENV) build dist *.egg-info
