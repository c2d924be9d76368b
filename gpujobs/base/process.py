"""A process of this machine named so that a reused pid is not it: its pid, its start time, the boot.

A pid alone names whichever process has that number now: after a reboot, or in another container's pid
namespace, it is an unrelated one. The start time (clock ticks since boot) with the pid names one process
of one boot, and the boot id tells the boots apart. Torch-free; the lease and the job side's watchers use it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def process_start(pid: int) -> Optional[str]:
    """When `pid` started (clock ticks since boot, from /proc), or None: with the pid, names one process,
    not whichever later reuses its number."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def process_state(pid: int) -> str:
    """`pid`'s state letter in /proc (R, S, T, Z, ...), or "" when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def alive(pid: int) -> bool:
    """Whether `pid` is a process that is not a zombie (`kill -0` succeeds on zombies)."""
    return process_state(pid) not in ("", "Z", "X")


def boot_id() -> Optional[str]:
    """This boot's id (the kernel's), or None where /proc does not say: a start time is of one boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def started_at(pid: int) -> Optional[float]:
    """When `pid` started, in seconds since the epoch (to about a second: the boot time is whole seconds),
    or None: for a record of a time that names no start ticks (a lease of an older gpujobs)."""
    ticks = process_start(pid)
    try:
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return None if ticks is None else btime + int(ticks) / os.sysconf("SC_CLK_TCK")
