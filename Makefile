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

# The deploy tests (tools and loopback servers, no hivemind) run in a second pytest beside the unit tests, which
# wait on loopback as much as they compute; then the integration and lab tests, one at a time: their swarms time
# their rounds and would starve each other. All runs go to the end; the last prints every tier's time
# (tests/conftest.py). (Not pytest-xdist: an in-process hivemind averager of a unit test hung in its worker.)
test: $(STAMP)
	rm -f $(VENV)/test-times.json
	export GEOTRAIN_TEST_TIMES=$(VENV)/test-times.json; deploy_log=$$(mktemp); \
	$(BIN)/python -m pytest -q -p no:cacheprovider --basetemp=$$(mktemp -d)/deploy --durations=5 tests/deploy \
		> $$deploy_log 2>&1 & deploy=$$!; \
	$(BIN)/python -m pytest -q --durations=5 tests/unit; unit=$$?; \
	wait $$deploy; deployed=$$?; echo "--- tests/deploy, run beside tests/unit:"; cat $$deploy_log; rm -f $$deploy_log; \
	$(BIN)/python -m pytest -q --durations=15 tests/integration tests/lab; swarms=$$?; \
	exit $$(( unit || deployed || swarms ))

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
