"""Shared pytest set-up. tests/fixtures/ is the tests' one support package: a fixture module per real
service (processes, MLflow, etcd, elastic jobs) and helpers (fake clock, certificates, a trainer without
Horovod, gated storages). The job harness itself is ``chaos/jobs.py`` (the benchmarks use it too)."""

pytest_plugins = [
    "tests.fixtures.procs",
    "tests.fixtures.mlflow_server",
    "tests.fixtures.etcd",
    "tests.fixtures.elastic_job",
    "tests.fixtures.s3_server",
    "tests.fixtures.launch",
]
