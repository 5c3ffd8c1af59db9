# The two commands of the README: `make demo` (a short multi-turn chat) and `make test`.
# Both set everything up on a fresh machine: virtual environment, llama.cpp build, models
# (and, for `make test`, Debian's chromium and chromedriver for the chat page's browser tests).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed

.PHONY: setup demo test lint bench clean-venv

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

setup: $(INSTALLED)
	$(PY) scripts/fetch_models.py
	$(PY) scripts/fetch_llama.py
	$(PY) scripts/make_fixtures.py

demo: setup
	$(PY) scripts/demo.py

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy --strict llmsession

test: setup lint
	$(PY) scripts/gen_bindings.py --check
	$(PY) scripts/fetch_browser.py
	@# Two runs, both always: the few tests that need both cores alone on them, then the rest on
	@# two workers with a core each (tests/conftest.py, SERIAL_FILES and `parallel`).
	status=0; \
	$(PY) -m pytest -q --no-skips --durations=30 -m "not parallel" || status=$$?; \
	$(PY) -m pytest -q --no-skips --durations=15 -m parallel -n 2 --dist loadfile --max-worker-restart=0 || status=$$?; \
	exit $$status

bench: setup
	$(PY) scripts/fetch_llama.py --bench
	$(PY) scripts/bench_sessions.py --json bench-sessions.json

clean-venv:
	rm -rf $(VENV)
