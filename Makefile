# Two entry points a fresh machine needs: `make run` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pytest workers: both cores of a CI machine (the interpreter is single-threaded)
JOBS ?= 2

.PHONY: venv run test lint clean

venv: $(STAMP)

# torch==2.13.0 resolves to the CPU build where a local CPU wheel is offered
# (pip's find-links on the project machines); on a GPU host use its own torch.
$(STAMP): pyproject.toml constraints-ci.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints-ci.txt -e ".[dev,bench]"
	touch $(STAMP)

run: venv
	$(VENV)/bin/fusedmoe run

# The interpreter is chosen when @triton.jit decorates, so it is set before Python starts.
test: venv
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not gpu" -n $(JOBS) $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV)
