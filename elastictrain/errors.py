"""The project's exception tree: every error elastictrain, discovery and chaos raise on purpose.

Catch :class:`ElastictrainError` for "any of ours"; catch a branch for a kind of failure. A class is
defined where it is raised when one module owns it (``discovery.registry.LeaseLost``,
``elastictrain.checkpoint.format.CheckpointDamaged``) and derives from a branch here; the branches,
and the classes that more than one part raises, are defined here. ::

    ElastictrainError
    ├── ConfigError (ValueError)      bad config, flag or environment variable: one line, exit code 2
    ├── RegistryError                 the membership store (etcd) failed or refused an operation
    │   └── RegistryUnavailable       no etcd endpoint answered; the next call may reconnect
    ├── InputError (ValueError)       damaged or hostile data read back: an etcd value, a ledger line
    ├── CheckpointError               a checkpoint cannot be written, read or moved as asked
    ├── LaunchError                   launch refused before it started anything: one line, exit code 2
    ├── ToolError                     a command (status, audit, demo, bench) cannot do what was asked
    └── ScenarioError                 a chaos scenario could not be carried out

A class that also derives from a built-in (``ValueError``, ``RuntimeError``) keeps it, so callers that
catch the built-in still work. Control flow that is not an error (a worker told to stop) is not in the
tree. Messages are one line meant for the user.

Import-light: standard library only and nothing at import time, because ``discover.sh`` imports it.
"""

from __future__ import annotations


class ElastictrainError(Exception):
    """Root of every exception the project raises on purpose."""


class ConfigError(ElastictrainError, ValueError):
    """A bad config file, key, value, ``--set`` override, flag or environment variable (exit code 2)."""


class RegistryError(ElastictrainError):
    """A registry (etcd) operation failed or was refused."""


class RegistryUnavailable(RegistryError):
    """No etcd endpoint answered in time; the next call reconnects (to the next endpoint when several)."""


class InputError(ElastictrainError, ValueError):
    """Data read back from etcd, the run_dir or a ledger is damaged or not what its format allows."""


class CheckpointError(ElastictrainError):
    """A checkpoint could not be written, read, verified or pointed to as asked."""


class LaunchError(ElastictrainError):
    """A user error found by ``elastictrain launch`` before anything was started (exit 2); the message is one line."""


class ToolError(ElastictrainError):
    """A command-line tool (``status``, ``audit``, ``demo``, benchmarks) cannot do what it was asked."""


class ScenarioError(ElastictrainError):
    """A chaos scenario could not be carried out (the job ended early, a wait timed out, a tier is missing)."""


def one_line(e: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` (at most ``limit`` characters), or ``Type`` alone for an empty one."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}"[:limit] if lines else type(e).__name__
