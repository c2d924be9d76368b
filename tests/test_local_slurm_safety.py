"""scripts/local-slurm.sh is safe on a shared machine: the cluster is root's, no other user gets in.

The live checks run against the cluster of the `slurm` fixture and try, as the unprivileged user
65534 (`setpriv`), what an other local user could: log into its MariaDB as root over the socket
and over TCP, read the munge key. The refusal checks hand `up`, `down`, `status` and `reset`
directories someone else made, for real (chown, chmod, a planted key), and see that nothing is
started, written or deleted.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import REPO, missing

SCRIPT = REPO / "scripts" / "local-slurm.sh"
NOBODY = 65534
MARKER_FORMAT = "gpujobs-local-slurm format=2\n"



@pytest.fixture
def root() -> None:
    """local-slurm.sh runs as root only (CI runs as root: there, not being root fails)."""
    if os.geteuid() != 0:
        missing("local-slurm.sh runs as root only")


def as_nobody(*cmd: str) -> subprocess.CompletedProcess[str]:
    """Run `cmd` as uid/gid 65534 without supplementary groups: any other local user."""
    if shutil.which("setpriv") is None:
        missing("setpriv (util-linux) is not installed")
    return subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd],
        capture_output=True,
        text=True,
        timeout=30,
        cwd="/",
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/nonexistent"},
    )


def mariadb(*args: str) -> list[str]:
    """The MariaDB client, reading no option files (none of root's could help, or hurt, a login)."""
    if shutil.which("mariadb") is None:
        missing("the MariaDB client is not installed")
    return ["mariadb", "--no-defaults", "--batch", "--skip-column-names", *args]


@pytest.fixture(scope="module")
def cluster_dir(slurm: dict[str, str]) -> Path:
    """DIR of the live cluster (SLURM_CONF is DIR/etc/slurm.conf)."""
    if os.geteuid() != 0:
        missing("the cluster is root's: these checks run as root")
    return Path(slurm["SLURM_CONF"]).parent.parent


@pytest.fixture(scope="module")
def mysql_port(cluster_dir: Path) -> str:
    """The TCP port (on 127.0.0.1) of the cluster's MariaDB, from its my.cnf."""
    match = re.search(r"^port=(\d+)$", (cluster_dir / "etc" / "my.cnf").read_text(), re.M)
    assert match, "no port= in my.cnf"
    return match.group(1)


@pytest.mark.slurm
def test_dir_is_roots_alone(cluster_dir: Path) -> None:
    info = os.lstat(cluster_dir)
    assert stat.S_ISDIR(info.st_mode), f"{cluster_dir} is not a real directory"
    assert info.st_uid == 0
    assert stat.S_IMODE(info.st_mode) == 0o700
    listing = as_nobody("ls", str(cluster_dir))
    assert listing.returncode != 0 and "Permission denied" in listing.stderr


@pytest.mark.slurm
def test_secrets_are_root_only_files(cluster_dir: Path) -> None:
    expected = {"etc/slurmdbd.conf": 0o600, "etc/mariadb-slurm.pass": 0o600, "munge/munge.key": 0o400}
    for name, mode in expected.items():
        info = os.lstat(cluster_dir / name)
        assert stat.S_ISREG(info.st_mode) and info.st_uid == 0, name
        assert stat.S_IMODE(info.st_mode) == mode, f"{name}: {stat.S_IMODE(info.st_mode):o}"
    password = (cluster_dir / "etc" / "mariadb-slurm.pass").read_text().strip()
    assert len(password) >= 32 and password != "slurm"
    assert f"StoragePass={password}\n" in (cluster_dir / "etc" / "slurmdbd.conf").read_text()


@pytest.mark.slurm
def test_others_cannot_read_the_munge_key(cluster_dir: Path) -> None:
    key = cluster_dir / "munge" / "munge.key"
    assert len(key.read_bytes()) == 1024  # root can: the key is there
    read = as_nobody("cat", str(key))
    assert read.returncode != 0 and "Permission denied" in read.stderr
    assert read.stdout == ""


@pytest.mark.slurm
def test_others_cannot_reach_mariadb_root_over_the_socket(cluster_dir: Path) -> None:
    socket = f"--socket={cluster_dir / 'run' / 'mysqld.sock'}"
    mine = subprocess.run(mariadb("-uroot", socket, "-e", "select current_user()"), capture_output=True, text=True)
    assert mine.returncode == 0 and mine.stdout.strip() == "root@localhost", mine.stderr  # root (uid 0) can
    theirs = as_nobody(*mariadb("-uroot", socket, "-e", "select 1"))
    assert theirs.returncode != 0 and "ERROR" in theirs.stderr
    assert theirs.stdout == ""


@pytest.mark.slurm
def test_no_one_logs_in_as_mariadb_root_over_tcp(mysql_port: str) -> None:
    tcp = ("-h127.0.0.1", f"-P{mysql_port}")
    for user in ("root", "mysql"):
        # "Access denied" (not "Can't connect"): the server was reached, and said no
        theirs = as_nobody(*mariadb(f"-u{user}", *tcp, "-e", "select 1"))
        assert theirs.returncode != 0 and "Access denied" in theirs.stderr, theirs.stderr
    # root@localhost authenticates by unix socket only: not even OS root gets in over TCP
    mine = subprocess.run(mariadb("-uroot", *tcp, "-e", "select 1"), capture_output=True, text=True)
    assert mine.returncode != 0 and "Access denied" in mine.stderr, mine.stderr
    # the accounting account's password is not the well-known one of older versions
    guessed = as_nobody(*mariadb("-uslurm", "--password=slurm", *tcp, "-e", "select 1"))
    assert guessed.returncode != 0 and "Access denied" in guessed.stderr, guessed.stderr


@pytest.mark.slurm
def test_accounting_account_cannot_write_files(cluster_dir: Path, mysql_port: str, tmp_path: Path) -> None:
    password = (cluster_dir / "etc" / "mariadb-slurm.pass").read_text().strip()
    # the password goes in an option file, not argv (argv is world-readable)
    options = tmp_path / "slurm.cnf"
    options.write_text(f"[client]\nuser=slurm\npassword={password}\nhost=127.0.0.1\nport={mysql_port}\n")
    options.chmod(0o600)
    login = ["mariadb", f"--defaults-file={options}", "--batch", "--skip-column-names"]
    ok = subprocess.run([*login, "-e", "select 1"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip() == "1", ok.stderr  # slurmdbd's way in works
    target = tmp_path / "outfile"
    denied = subprocess.run([*login, "-e", f"select 1 into outfile '{target}'"], capture_output=True, text=True)
    assert denied.returncode != 0 and "FILE privilege" in denied.stderr, denied.stderr
    assert not target.exists()


# ------------------------------------------------------------------------------------ refusals


def _foreign(base: Path) -> Path:
    """Made by user 65534, world-writable, with a munge key and even our marker planted."""
    d = base / "cluster"
    (d / "munge").mkdir(parents=True)
    (d / "munge" / "munge.key").write_bytes(b"\0" * 1024)
    (d / ".gpujobs-local-slurm").write_text(MARKER_FORMAT + "munge_key=generated\n")
    for p in (d, d / "munge", d / "munge" / "munge.key", d / ".gpujobs-local-slurm"):
        os.chown(p, NOBODY, NOBODY)
    (d / "munge" / "munge.key").chmod(0o400)
    d.chmod(0o777)
    return d


def _symlink(base: Path) -> Path:
    """A symlink to a directory that would pass every other check."""
    real = base / "real"
    real.mkdir(mode=0o700)
    (real / ".gpujobs-local-slurm").write_text(MARKER_FORMAT)
    (base / "cluster").symlink_to(real)
    return base / "cluster"


def _world_writable(base: Path) -> Path:
    """Root's, with our marker, but anyone may have added or swapped files in it."""
    d = base / "cluster"
    d.mkdir()
    (d / ".gpujobs-local-slurm").write_text(MARKER_FORMAT)
    d.chmod(0o777)
    return d


def _no_marker(base: Path) -> Path:
    """Root's and 0700, but not empty and not made by the script (a key is already in it)."""
    d = base / "cluster"
    (d / "munge").mkdir(parents=True)
    (d / "munge" / "munge.key").write_bytes(b"\0" * 1024)
    d.chmod(0o700)
    return d


def _open_parent(base: Path) -> Path:
    """Not there yet, but in a directory of 65534's that anyone may write (no sticky bit)."""
    parent = base / "open"
    parent.mkdir()
    os.chown(parent, NOBODY, NOBODY)
    parent.chmod(0o777)
    return parent / "cluster"


def _snapshot(path: Path) -> list[tuple[str, int, int, bytes]]:
    """Every entry under path (itself included, not followed): name, owner, mode, file bytes."""
    if not os.path.lexists(path):
        return []
    entries = [path, *sorted(path.rglob("*"))] if path.is_dir() and not path.is_symlink() else [path]
    out = []
    for p in entries:
        info = os.lstat(p)
        data = p.read_bytes() if stat.S_ISREG(info.st_mode) else b""
        out.append((str(p), info.st_uid, info.st_mode, data))
    return out


def _processes_naming(path: Path) -> list[str]:
    """PIDs whose command line or environment names `path` (the script's daemons all do)."""
    found = []
    needle = str(path).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or proc.name == str(os.getpid()):
            continue
        try:
            if needle in (proc / "cmdline").read_bytes() or needle in (proc / "environ").read_bytes():
                found.append(proc.name)
        except OSError:
            continue
    return found


def _run_script(command: str, directory: Path) -> subprocess.CompletedProcess[str]:
    # ports and names of no real cluster: were anything started, it could not disturb one
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("GPUJOBS_SLURM_", "SLURM_"))},
        "GPUJOBS_SLURM_CTLD_PORT": "7717",
        "GPUJOBS_SLURM_DBD_PORT": "7719",
        "GPUJOBS_SLURM_MYSQL_PORT": "7720",
        "GPUJOBS_SLURM_SLURMD_PORT_BASE": "7730",
        "GPUJOBS_SLURM_CLUSTER": "refusal",
        "GPUJOBS_SLURM_TIMEOUT": "5",
    }
    return subprocess.run(
        ["bash", str(SCRIPT), command, str(directory)], capture_output=True, text=True, timeout=60, env=env
    )


@pytest.mark.usefixtures("root")
@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (_foreign, "belongs to uid 65534"),
        (_symlink, "symbolic link"),
        (_world_writable, "others may write to it"),
        (_no_marker, "not made by this script"),
        (_open_parent, "directory above it"),
    ],
    ids=["someone-elses", "symlink", "world-writable", "no-marker", "open-parent"],
)
def test_up_refuses_a_dir_it_did_not_make(tmp_path: Path, make: Callable[[Path], Path], reason: str) -> None:
    directory = make(tmp_path)
    before = _snapshot(tmp_path)
    done = _run_script("up", directory)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing" in lines[0] and str(directory) in lines[0] and reason in lines[0], lines
    assert done.stdout == ""  # no "export SLURM_CONF=..." to eval
    assert _snapshot(tmp_path) == before  # nothing written, nothing created (DIR included)
    assert _processes_naming(directory) == []  # no daemon started for it
    assert str(directory) not in Path("/etc/hosts").read_text()


@pytest.mark.usefixtures("root")
@pytest.mark.parametrize("command", ["down", "status", "reset"])
def test_other_commands_leave_someone_elses_dir_alone(tmp_path: Path, command: str) -> None:
    """down/status would run Slurm clients (as root) on its slurm.conf; reset would delete it."""
    directory = _foreign(tmp_path)
    (directory / "etc").mkdir()
    (directory / "etc" / "slurm.conf").write_text("PluginDir=/nonexistent\n")
    before = _snapshot(tmp_path)
    done = _run_script(command, directory)
    assert done.returncode != 0 and "refusing" in done.stderr and "belongs to uid 65534" in done.stderr
    assert _snapshot(tmp_path) == before
