"""The one runner of Slurm's commands (sbatch, squeue, sacct, scontrol, scancel, sinfo, sacctmgr).

Every call of a Slurm command in gpujobs goes through `slurm_command`: an argument list (never a
shell string), a timeout, and on failure one `SlurmCommandError` whose message carries the command
and the last line it wrote to stderr (Slurm's reason: "Invalid job id specified", "fatal: ...").
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from typing import Optional

from gpujobs.backends.slurm.relay import ask, relay_for
from gpujobs.base.errors import SchedulerError

#: How long a Slurm command may take unless its caller says otherwise: slurmctld answers in well under
#: a second when it is healthy; one that is busy or restarting takes seconds, not minutes.
DEFAULT_TIMEOUT_S = 30.0


class SlurmCommandError(SchedulerError):
    """A Slurm command could not run, did not answer in time, or failed; the message is one line."""

    def __init__(self, command: Sequence[str], reason: str, returncode: Optional[int] = None) -> None:
        self.command = list(command)
        self.reason = reason
        self.returncode = returncode
        shown = " ".join(self.command[:4]) + (" ..." if len(self.command) > 4 else "")
        # the tool's name first ("sacct could not run: ..."), then the call it was: the line a user reads
        super().__init__(f"{self.command[0] if self.command else 'a Slurm command'} {reason} (`{shown}`)")


def last_line(text: str) -> str:
    """The last non-empty line of a command's output: where Slurm's tools say why they failed."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def slurm_command(command: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S,
                  env: Optional[Mapping[str, str]] = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one Slurm command; its completed process (stdout and stderr as text).

    `env` is added to this process's environment. Raises SlurmCommandError when the command cannot
    run or times out, and (with `check`) when it exits non-zero, with its stderr's last line. A rank in a
    container whose image lacks the command has the supervisor outside run it (`relay`)."""
    relay = relay_for(command)
    if relay is None:
        proc = _run(command, timeout_s, env)
    else:
        relayed = ask(relay, command, timeout_s, env)
        if isinstance(relayed, str):
            raise SlurmCommandError(command, relayed)
        proc = subprocess.CompletedProcess(list(command), *relayed)
    if check and proc.returncode != 0:
        said = last_line(proc.stderr) or last_line(proc.stdout) or f"exit status {proc.returncode}"
        raise SlurmCommandError(command, f"failed: {said}", proc.returncode)
    return proc


def _run(command: Sequence[str], timeout_s: float,
         env: Optional[Mapping[str, str]]) -> subprocess.CompletedProcess[str]:
    """Run `command` here; SlurmCommandError when it cannot run or does not answer in time."""
    try:
        return subprocess.run(list(command), capture_output=True, text=True, errors="replace", timeout=timeout_s,
                              check=False, env={**os.environ, **env} if env else None)
    except subprocess.TimeoutExpired:
        raise SlurmCommandError(command, f"did not answer within {timeout_s:g} s") from None
    except OSError as err:
        raise SlurmCommandError(command, f"could not run: {err.strerror or err}") from None


def slurm_output(command: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 env: Optional[Mapping[str, str]] = None) -> str:
    """The standard output of a Slurm command that must succeed (SlurmCommandError otherwise)."""
    return slurm_command(command, timeout_s=timeout_s, env=env).stdout
