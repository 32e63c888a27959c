# elastictrain — see README.md. `make test` is what CI runs.
PY      := .venv/bin/python
STAMP   := .venv/.setup-done
PYTEST  := .venv/bin/pytest

.PHONY: setup test test-unit test-long docs test-integration lint format demo bench bench-quick gpu-check chaos chaos-campaign clean peers-env bench-peers

# Setup is idempotent; the stamp makes `make test` skip it when nothing it depends on changed.
$(STAMP): scripts/setup.sh elastictrain/horovod/patch.py constraints/torch.txt pyproject.toml
	bash scripts/setup.sh
	@touch $(STAMP)

setup:
	bash scripts/setup.sh
	@touch $(STAMP)

# The suite includes tests/unit/test_docs_site.py: `mkdocs build --strict` of the docs site (a broken link,
# anchor or page outside the nav fails).
test: $(STAMP)
	$(PYTEST) -q -ra tests

test-unit: $(STAMP)
	$(PYTEST) -q tests/unit

# The tests marked long (real jobs that measure a goal or repeat what make test proves more briefly).
test-long: $(STAMP)
	ELASTICTRAIN_LONG=1 $(PYTEST) -q -ra -m long tests

test-integration: $(STAMP)
	$(PYTEST) -q -m integration tests

# The docs site (mkdocs.yml, docs/) served at http://127.0.0.1:8000, rebuilt on every edit.
docs: $(STAMP)
	.venv/bin/mkdocs serve

# Python (ruff, mypy), the Dockerfile (hadolint) and the Kubernetes manifests (kubernetes-validate, strict: unknown
# fields are errors). The last two come with the dev extras.
lint: $(STAMP)
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
	.venv/bin/hadolint Dockerfile
	.venv/bin/kubernetes-validate --strict --quiet deploy/k8s/*.yaml

format: $(STAMP)
	.venv/bin/ruff format .
	.venv/bin/ruff check --fix .

# A real elastic job on this machine with faults (elastictrain/tools/demo.py): a few minutes, then a summary.
demo: $(STAMP)
	$(PY) -m elastictrain.tools.demo

# Every performance goal measured side by side (bench/, run from the checkout): results to bench/results/<date>-<host>.json/.md.
bench: $(STAMP)
	$(PY) -m bench

# The quick modes of the fast measurements (bench.QUICK_RUN); `python -m bench --help` lists each one's last time.
bench-quick: $(STAMP)
	$(PY) -m bench --quick

# The checks that need a CUDA GPU (bench/gpu_check.py), ~4 min on one GPU; table to runs/gpu-check/.
# Without a GPU: one line, exit 0.
gpu-check: $(STAMP)
	$(PY) -m bench.gpu_check

# Chaos: every scenario (the long ones too), a short fault campaign (24 faults over every phase; its table in its
# run dir), then the soak (a SIGKILL every 60 s for 20 min plus one of each other fault) with its invariant table,
# report.png and report.json in the run dir. Only `kill-worker` also runs in `make test`. A shortened soak:
# make chaos CHAOS_ARGS=--quick
CHAOS_ARGS ?=
chaos: $(STAMP)
	ELASTICTRAIN_CHAOS_LONG=1 $(PYTEST) -q -ra tests/chaos
	d=runs/chaos/campaign-short-$$(date +%Y%m%d-%H%M%S); $(PY) -m chaos campaign --faults 24 --seed 1 --run-dir $$d --out $$d.json
	$(PY) -m chaos run soak --run-dir runs/chaos/soak-$$(date +%Y%m%d-%H%M%S) $(CHAOS_ARGS)

# The fault campaign (chaos/campaign.py): 300 faults aimed at every phase x kind of one 4-worker job, then the
# invariants and the figures per phase x kind, to bench/results/<date>-<host>-campaign.json/.md. 37-52 minutes
# on 2 cores (the runs of 2026-12-04 and -05), plus a fault-free run of the same job the first time (36 minutes there;
# cached under runs/chaos/.chaos-reference). CAMPAIGN_ARGS=--no-reference skips it.
CAMPAIGN_FAULTS ?= 300
CAMPAIGN_SEED ?= 1
CAMPAIGN_ARGS ?=
chaos-campaign: $(STAMP)
	$(PY) -m chaos campaign --faults $(CAMPAIGN_FAULTS) --seed $(CAMPAIGN_SEED) $(CAMPAIGN_ARGS)

# The contenders of `python -m bench --only peers` (torchrun and TorchFT) in their own environment, never in
# the product's: torch from constraints/torch.txt (as scripts/setup.sh installs it) and the newest TorchFT on the
# index, torchft-nightly (0.2.0's DDP hook crashes every replica group when a peer dies: meta-pytorch/torchft#304).
PEERS_VENV := .peers-venv
TORCHFT_PIN := torchft-nightly==2026.10.26
peers-env:
	python3.11 -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip uninstall -q -y torchft  # a 0.2.0 left from before would shadow the nightly's package
	$(PEERS_VENV)/bin/python -m pip install -q --disable-pip-version-check -c constraints/torch.txt torch $(TORCHFT_PIN) numpy
	$(PEERS_VENV)/bin/python -c "import importlib.metadata as m, torch, torchft; print('peers-env: torch', torch.__version__, '$(TORCHFT_PIN)'.split('==')[0], m.version('$(TORCHFT_PIN)'.split('==')[0]))"

# elastictrain, stock Horovod, torchrun and TorchFT side by side (needs `make peers-env`); BENCH_ARGS=--quick
BENCH_ARGS ?=
bench-peers: $(STAMP)
	$(PY) -m bench --only peers $(BENCH_ARGS)

clean:
	rm -rf .pytest_cache .mypy_cache .ruff_cache runs
