"""Slurm's commands for ranks in a container, run by the supervisor beside them (torch-free).

An image seldom holds Slurm's client (`scontrol` with the site's libslurm, munge socket and slurm.conf), yet
rank 0 requeues its job (`scontrol requeue`) and excludes nodes from inside the step. The supervisor, in the
batch step outside the container, runs them for it: it names a directory in the ranks' environment
(`RELAY_ENV`, a directory of the run dir: the nodes share it); `slurm_command` in a process whose command is
not on its PATH writes the request there (`req-<token>.json`, atomically) and waits for the answer
(`res-<token>.json`) that the supervisor's `Relay` writes once it ran the command. Only Slurm's own commands
are run (`COMMANDS`), through the same runner as everywhere else.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

from gpujobs.base.atomic import write_json_atomic
from gpujobs.rundir.trust import own_dir

#: The relay directory of the step the ranks run in, set by the supervisor for a containerized step.
RELAY_ENV = "GPUJOBS_SLURM_RELAY"
#: What the relay runs: Slurm's commands, nothing else.
COMMANDS = frozenset({"scontrol", "scancel", "squeue", "sacct", "sinfo"})
_POLL_S = 0.05
#: How much longer than the command's own timeout a rank waits for its answer (the relay's poll, a busy disk).
_SLACK_S = 10.0
#: The pid of the supervisor serving a relay: it runs its commands itself (one it lacks is not to be relayed to itself).
_serving: Optional[int] = None


def relay_for(command: Sequence[str]) -> Optional[Path]:
    """The relay directory `command` goes through: where the supervisor set one and the command is not on this
    process's PATH (a rank in an image without Slurm's client); None: run it here."""
    relay = os.environ.get(RELAY_ENV)
    if not relay or not command or _serving == os.getpid() or shutil.which(command[0]) is not None:
        return None
    return Path(relay)


def ask(relay: Path, command: Sequence[str], timeout_s: float,
        env: Optional[Mapping[str, str]]) -> Union[tuple[int, str, str], str]:
    """Have the supervisor run `command`; its exit code, stdout and stderr, or why it could not run (one line)."""
    token = uuid.uuid4().hex
    answer_path = relay / f"res-{token}.json"
    try:
        write_json_atomic(relay / f"req-{token}.json",
                          {"command": list(command), "timeout_s": timeout_s, "env": dict(env or {})})
    except OSError as err:
        return f"could not be relayed to the supervisor through {relay}: {err.strerror or err}"
    deadline = time.monotonic() + timeout_s + _SLACK_S
    while time.monotonic() < deadline:
        try:
            answer = json.loads(answer_path.read_text())
        except (FileNotFoundError, ValueError):  # not there yet (written atomically: never half)
            time.sleep(_POLL_S)
            continue
        with contextlib.suppress(OSError):
            answer_path.unlink()
        if "error" in answer:
            return str(answer["error"])
        return int(answer["returncode"]), str(answer["stdout"]), str(answer["stderr"])
    return f"was relayed to the supervisor through {relay}, which did not answer within {timeout_s + _SLACK_S:g} s"


class Relay:
    """The supervisor's side: runs the requests the ranks leave in `directory` until stopped."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="gpujobs-slurm-relay", daemon=True)

    def __enter__(self) -> Relay:
        global _serving
        _serving = os.getpid()
        own_dir(self.directory.parent, self.directory.name, mode=0o700)  # a link or another's dir: Untrusted
        os.environ[RELAY_ENV] = str(self.directory)  # the srun step, and every rank, inherit it
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        global _serving
        _serving = None
        os.environ.pop(RELAY_ENV, None)
        shutil.rmtree(self.directory, ignore_errors=True)

    def _serve(self) -> None:
        """Answer every request until stopped, oldest first."""
        while not self._stop.is_set():
            for request in sorted(self.directory.glob("req-*.json"), key=_mtime):
                self._answer(request)
            self._stop.wait(_POLL_S)

    def _answer(self, request: Path) -> None:
        """Run one request's command and write its answer beside it (a request that does not read is dropped)."""
        from gpujobs.backends.slurm.commands import SlurmCommandError, slurm_command

        token = request.name.removeprefix("req-").removesuffix(".json")
        try:
            asked = json.loads(request.read_text())
            request.unlink()
            command = [str(word) for word in asked["command"]]
        except (OSError, ValueError, KeyError, TypeError):
            return
        answer: dict[str, Any]
        if not command or command[0] not in COMMANDS:
            answer = {"error": f"is not one of Slurm's commands the supervisor runs ({', '.join(sorted(COMMANDS))})"}
        else:
            try:
                proc = slurm_command(command, timeout_s=float(asked.get("timeout_s", 30)), env=asked.get("env") or None,
                                     check=False)
                answer = {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
            except SlurmCommandError as err:
                answer = {"error": err.reason}
        with contextlib.suppress(OSError):
            write_json_atomic(self.directory / f"res-{token}.json", answer)


def _mtime(path: Path) -> float:
    """When `path` was written (0 for one already gone)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
