"""Shared pytest set-up. tests/fixtures/ is the tests' one support package: a fixture module per real
service (processes, MLflow, etcd, elastic jobs) and helpers (fake clock, certificates, a trainer without
Horovod, gated storages). The job harness itself is ``chaos/jobs.py`` (the benchmarks use it too).

A test marked ``long`` runs only with ``ELASTICTRAIN_LONG=1`` (``make test-long``): real jobs that measure a goal
or repeat what a shorter test of ``make test`` already proves, kept out so that ``make test`` stays within its time."""

import os

import pytest

pytest_plugins = [
    "tests.fixtures.procs",
    "tests.fixtures.mlflow_server",
    "tests.fixtures.etcd",
    "tests.fixtures.elastic_job",
    "tests.fixtures.s3_server",
    "tests.fixtures.launch",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("ELASTICTRAIN_LONG") == "1":
        return
    skip = pytest.mark.skip(reason="a long test of `make test-long` (ELASTICTRAIN_LONG=1)")
    for item in items:
        if item.get_closest_marker("long") is not None:
            item.add_marker(skip)
