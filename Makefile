# What a new user needs: `make demo` and `make test` (each creates .venv on first use), plus
# `make bench` (short headline benchmarks of the three packages) and `make lint` (ruff).
# The venv gets `pip install -e '.[all]'`: the core, the serve and GAN extras and the test tools.

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The first Python >= 3.11 on PATH; override with `make PYTHON=/path/to/python3.x ...`.
PYTHON_CANDIDATES := python3.11 python3.12 python3.13 python3
ifeq ($(origin PYTHON), undefined)
PYTHON := $(shell for p in $(PYTHON_CANDIDATES); do \
	if command -v $$p >/dev/null 2>&1 && \
	   $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then \
	echo $$p; break; fi; done)
endif

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	@if [ ! -x $(PY) ] && [ -z "$(PYTHON)" ]; then \
	  echo "error: no Python >= 3.11 found (tried: $(PYTHON_CANDIDATES))." >&2; \
	  echo "Install Python 3.11, 3.12 or 3.13, or run: make PYTHON=/path/to/python3.x $(MAKECMDGOALS)" >&2; \
	  exit 1; \
	fi
	@if [ ! -x $(PY) ] && ! $(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
	  echo "error: PYTHON=$(PYTHON) is not a Python >= 3.11" >&2; exit 1; \
	fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
	  echo "error: $(VENV) has Python older than 3.11; run make clean and use a newer one" >&2; \
	  exit 1; }
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[all]'
	touch $(STAMP)

demo: $(STAMP)
	bash scripts/demo.sh

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	bash scripts/bench.sh

clean:
	rm -rf $(VENV) build *.egg-info
