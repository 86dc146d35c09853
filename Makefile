# Two commands from a fresh clone: `make demo` (a local swarm) and `make test`.
# Both create .venv on first use; it is rebuilt when setup.cfg changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test unit integration bench lab-bench wheelhouse clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/geotrain local --peers 3 --task cv --epochs 5 --target-batch-size 1024 --lr 0.01 \
		--run-dir runs/demo --json runs/demo/summary.json

# One test at a time: the swarms of integration and lab tests time their rounds and would starve each other,
# and the unit tier beside another (pytest-xdist, or the deploy tier alongside) hung or aborted in CI.
# The deploy tests' tool environments (.venv-tools, .venv-sky: tests/deploy/deploy_tools.py) build beside .venv
# on a fresh clone, not inside the first deploy test; a test that finds one still building waits for it (a lock).
test:
	@$(PYTHON) tests/deploy/deploy_tools.py & tools=$$!; \
	$(MAKE) --no-print-directory $(STAMP) || { wait $$tools; exit 1; }; \
	$(BIN)/python -m pytest -q --durations=15 tests; status=$$?; wait $$tools; exit $$status

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

integration: $(STAMP)
	$(BIN)/python -m pytest -q tests/integration

bench: $(STAMP)
	$(BIN)/python benchmarks/trainer_overhead.py --output benchmarks/results/trainer_overhead.json

# [EMJ24] setups A-4, B-4, C-4 in the lab (needs root: network namespaces); about 10 minutes
lab-bench: $(STAMP)
	$(BIN)/python benchmarks/lab_bench.py

# The offline bundle for a GPU machine with no package index (docs/gpu.md, "Offline install"): the wheels for
# Python $(PY_VERSION) on x86-64 Linux that a machine with the packages of $(TARGET_HAS) lacks, and geotrain.
PY_VERSION ?= 3.12
TARGET_HAS ?= benchmarks/gpu/target-packages.txt
wheelhouse:
	$(PYTHON) benchmarks/gpu/wheelhouse.py --python-version $(PY_VERSION) --target-has $(TARGET_HAS) --out .wheelhouse

clean:
	rm -rf $(VENV) runs .pytest_cache
