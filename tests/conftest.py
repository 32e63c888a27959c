"""Shared pytest set-up. Fixture modules live in tests/fixtures/ (one per real service)."""

pytest_plugins = [
    "tests.fixtures.procs",
    "tests.fixtures.mlflow_server",
    "tests.fixtures.etcd",
]
