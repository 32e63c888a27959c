# elastictrain — see README.md. `make test` is what CI runs.
PY      := .venv/bin/python
STAMP   := .venv/.setup-done
PYTEST  := .venv/bin/pytest

.PHONY: setup test test-unit test-integration lint format demo bench bench-quick chaos clean

# Setup is idempotent; the stamp makes `make test` skip it when nothing it depends on changed.
$(STAMP): scripts/setup.sh constraints/torch.txt pyproject.toml
	bash scripts/setup.sh
	@touch $(STAMP)

setup:
	bash scripts/setup.sh
	@touch $(STAMP)

test: $(STAMP)
	$(PYTEST) -q -ra tests

test-unit: $(STAMP)
	$(PYTEST) -q tests/unit

test-integration: $(STAMP)
	$(PYTEST) -q -m integration tests

lint: $(STAMP)
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy

format: $(STAMP)
	.venv/bin/ruff format .
	.venv/bin/ruff check --fix .

# A real elastic job on this machine with faults (elastictrain/demo.py): a few minutes, then a summary.
demo: $(STAMP)
	$(PY) -m elastictrain.demo

# Every performance goal measured side by side (elastictrain/bench/): results to bench/results/<date>-<host>.json/.md.
bench: $(STAMP)
	$(PY) -m elastictrain.cli bench

# The same in under 5 minutes: fewer repeats, a 2-minute goodput run.
bench-quick: $(STAMP)
	$(PY) -m elastictrain.cli bench --quick

clean:
	rm -rf .pytest_cache .mypy_cache .ruff_cache runs
