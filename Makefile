# The torch requirement is a variable so CI can pin the CPU build (see .ci/run).
TORCH_SPEC ?= torch
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= dev,ray,docs

.PHONY: install demo test docs bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m orchestrator.faces.demo

# The suite on TEST_WORKERS processes (pytest-xdist; tests that share a resource, such as the emulated Slurm nodes,
# are one xdist group and run on one worker). TEST_WORKERS=0 runs it in this one process. Two on two cores: three
# left the cores less idle but made each test 30-100% longer, for a whole run within noise (benchmarks/RESULTS.md).
TEST_WORKERS ?= 2

test: install
	$(PY) -m pytest -q --durations=30 -n $(TEST_WORKERS) --dist loadgroup

# The user documentation (docs/, mkdocs.yml) into build/site; --strict: a broken link or a missing page fails
# (NO_MKDOCS_2_WARNING: mkdocs-material's notice about MkDocs 2, not a warning about these documents).
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d build/site

bench: install
	for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
