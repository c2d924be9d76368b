"""The exceptions gpujobs raises on purpose; anything else is a bug."""

from __future__ import annotations

from collections.abc import Sequence


class GpujobsError(Exception):
    """Base class: an error the user can act on, reported as one line."""

    culprit_ranks: Sequence[int] = ()
    """The ranks an error raised on every rank at once knows to be its cause (a failed save: those whose
    write failed), so the ledger blames one of them, not the fastest echo; empty where it knows none."""


class ConfigError(GpujobsError, ValueError):
    """A config value is invalid; the message names the key, the value and what is allowed."""

    def __init__(self, key: str, value: object, allowed: str) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        super().__init__(f"{key}={value!r} is invalid: allowed {allowed}")

    def __reduce__(self) -> tuple[type[ConfigError], tuple[object, ...]]:
        # rebuilt from its parts, not its message: a worker process's error reaches its parent whole
        return (type(self), (self.key, self.value, self.allowed))

    def under(self, prefix: str) -> ConfigError:
        """The same error with its key placed under `prefix` (e.g. "model")."""
        return ConfigError(f"{prefix}.{self.key}", self.value, self.allowed)


class SubmitError(GpujobsError):
    """The job could not be submitted or launched (the executor said why)."""


class SchedulerError(GpujobsError):
    """A scheduler could not be asked (a Slurm command failed, the Kubernetes API did not answer): not the
    user's input, so the commands that manage jobs exit 1 on it, not 2. The message is one line."""
