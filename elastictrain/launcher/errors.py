"""The launcher's user error: found before anything was started, reported as one line with exit code 2."""

from elastictrain.errors import ElastictrainError


class LaunchError(ElastictrainError):
    """A user error found before anything was started (exit 2); the message is one line."""
