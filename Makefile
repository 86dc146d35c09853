# Two commands from a fresh clone: `make demo` (a local swarm) and `make test`.
# Both create .venv on first use; it is rebuilt when setup.cfg changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test unit integration bench clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/geotrain local --peers 3 --task cv --epochs 5 --target-batch-size 1024 --lr 0.01 \
		--run-dir runs/demo --json runs/demo/summary.json

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

integration: $(STAMP)
	$(BIN)/python -m pytest -q tests/integration

bench: $(STAMP)
	$(BIN)/python benchmarks/trainer_overhead.py --output benchmarks/results/trainer_overhead.json

clean:
	rm -rf $(VENV) runs .pytest_cache
