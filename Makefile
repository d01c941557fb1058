# Two targets a new user needs: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	bash scripts/demo.sh

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
