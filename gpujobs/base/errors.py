"""The exceptions gpujobs raises on purpose; anything else is a bug."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import Optional


class GpujobsError(Exception):
    """Base class: an error the user can act on, reported as one line."""

    culprit_ranks: Sequence[int] = ()
    """The ranks an error raised on every rank at once knows to be its cause (a failed save: those whose
    write failed), so the ledger blames one of them, not the fastest echo; empty where it knows none."""


class ConfigError(GpujobsError, ValueError):
    """A config value is invalid; the message names the key, the value and what is allowed.

    `suggestion` (the full key an unknown key likely meant: `closest_key`) is said first, as
    `did you mean optim.lr?`: a typo's fix reads at once, before the list of every key.
    """

    def __init__(self, key: str, value: object, allowed: str, suggestion: Optional[str] = None) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        self.suggestion = suggestion
        meant = f"did you mean {suggestion}? " if suggestion else ""
        super().__init__(f"{key}={value!r} is invalid: {meant}allowed {allowed}")

    def __reduce__(self) -> tuple[type[ConfigError], tuple[object, ...]]:
        # rebuilt from its parts, not its message: a worker process's error reaches its parent whole
        return (type(self), (self.key, self.value, self.allowed, self.suggestion))

    def under(self, prefix: str) -> ConfigError:
        """The same error with its key placed under `prefix` (e.g. "model")."""
        suggestion = f"{prefix}.{self.suggestion}" if self.suggestion else None
        return ConfigError(f"{prefix}.{self.key}", self.value, self.allowed, suggestion)


def closest_key(name: str, keys: Iterable[object]) -> Optional[str]:
    """The one of `keys` that an unknown key `name` most likely meant (difflib's closest), or None where none
    is close: `lrr` -> `lr`, `embeding_dim` -> `embedding_dim`. The cutoff is above difflib's 0.6, which
    offers `name` for `namespace`: a wrong guess costs more than none."""
    found = difflib.get_close_matches(name, [str(key) for key in keys], n=1, cutoff=0.75)
    return found[0] if found else None


class SubmitError(GpujobsError):
    """The job could not be submitted or launched (the executor said why)."""


class SchedulerError(GpujobsError):
    """A scheduler could not be asked (a Slurm command failed, the Kubernetes API did not answer): not the
    user's input, so the commands that manage jobs exit 1 on it, not 2. The message is one line."""
