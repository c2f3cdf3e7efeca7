# Two commands on a fresh machine:  `make run` (the main job) and `make test` (the tests).
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?= repro

.PHONY: setup run test
setup: $(VENV)/.installed

$(VENV)/.installed: requirements-cpu.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-cpu.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

run: setup
	$(VENV)/bin/sid $(ARGS)

test: setup
	$(PY) -m pytest -q tests
