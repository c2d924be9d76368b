#!/usr/bin/env bash
# scripts/test-image.sh -- the container image the tests run ranks in, built offline and cached.
#
# Debian 12, run as root, inside the project's environment (its python runs pip; scripts/test.sh and the
# test fixtures call this script).
#
#   test-image.sh          build the image if needed; print its directory (a rootfs for ch-run, and
#                          the rootfs of the `oci` bundle) as the last line of stdout
#   test-image.sh podman   also make the same rootfs a Podman image, and prepare this host for podman as
#                          root; print "CONTAINERS_CONF=FILE" (a containers.conf every podman call of the
#                          tests must be given, see below), then the image name as the last line
#   test-image.sh oci      also make an OCI bundle of the same rootfs for Slurm's `srun --container` (crun,
#                          see oci_bundle below); print the bundle's directory as the last line
#
# Only those lines go to stdout; progress goes to stderr.
#
# The image: `mmdebstrap --variant=minbase --include=python3 bookworm` (Python 3.11, as the venv's) from the
# Debian mirror apt uses here (/etc/apt/sources.list.d/debian.sources, or mmdebstrap's default), then torch
# (the caller's version: the CPU build here, from this machine's wheel mirror) and the project with its
# runtime dependencies, installed by the caller's pip into /usr/local/lib/python3.11/dist-packages, where
# Debian's python3 looks. The tests mount the checkout over the installed project (ranks run `python3 -m`
# with the submit directory as cwd), so the image depends on pyproject.toml's dependencies, not on the code.
#
# The cache: CACHE=${GPUJOBS_TEST_IMAGE_CACHE:-$HOME/.cache/gpujobs/test-image}, made by this script with
# mkdir -m 700 and used only while it is a real directory of ours that no one else may write to (the image
# runs as root: a planted file would be code run by root). The image is CACHE/KEY, KEY a hash of this
# script, pyproject.toml and the torch version; it is built in CACHE/.build-KEY.* and renamed to CACHE/KEY
# only when whole, so a killed build leaves nothing that counts as done. A new KEY removes the old ones
# (directories and podman tags). Builds are serialized by flock on CACHE/.lock (the two pytest lanes of
# scripts/test.sh may ask at once); a warm call prints the path in a fraction of a second.
#
# Knobs: GPUJOBS_TEST_IMAGE_CACHE (above), GPUJOBS_TEST_IMAGE_PYTHON [python3] the python whose pip and
# torch version are used (the test fixtures pass their own interpreter).
set -euo pipefail
# The image is root's but must be readable inside containers (pip's files included): 022, not 077.
umask 022

log() { echo "test-image: $*" >&2; }
die() { log "ERROR: $*"; exit "${2:-1}"; }
usage() { echo "usage: $0 [podman|oci]" >&2; exit 2; }

[ $# -le 1 ] || usage
MODE=${1:-dir}
case $MODE in dir|podman|oci) ;; *) usage ;; esac
[ "$(id -u)" -eq 0 ] || die "must run as root (mmdebstrap builds the image as root; the image is root's)"

REPO=$(cd "$(dirname "$0")/.." && pwd -P)
PY=${GPUJOBS_TEST_IMAGE_PYTHON:-python3}
CACHE=$(realpath -m -s -- "${GPUJOBS_TEST_IMAGE_CACHE:-$HOME/.cache/gpujobs/test-image}")
[ "$CACHE" != / ] || die "GPUJOBS_TEST_IMAGE_CACHE must not be /" 2

# refuse: the cache dir is someone else's (or may be changed by someone else): nothing in it is used
refuse() { die "refusing GPUJOBS_TEST_IMAGE_CACHE=$CACHE: $*; use a directory this script makes (ours, mode 700)" 2; }

# check_cache: CACHE, made now if missing, is a real directory of ours that only we may write to, below
# directories that are root's and in which no one else may rename entries (or sticky, as /tmp)
check_cache() {
  local uid mode p
  if [ ! -e "$CACHE" ] && [ ! -L "$CACHE" ]; then
    mkdir -p -- "${CACHE%/*}/"
    mkdir -m 700 -- "$CACHE" || refuse "could not make it"
  fi
  [ ! -L "$CACHE" ] || refuse "it is a symbolic link"
  [ -d "$CACHE" ] || refuse "it is not a directory"
  read -r uid mode < <(stat -c '%u %a' -- "$CACHE")
  [ "$uid" = "$(id -u)" ] || refuse "it belongs to uid $uid, not to us (uid $(id -u))"
  (( (8#$mode & 8#077) == 0 )) || refuse "its mode is $mode, not 700"
  p=$(realpath -e -- "${CACHE%/*}/")
  while :; do
    read -r uid mode < <(stat -c '%u %a' -- "$p")
    [ "$uid" = 0 ] && (( (8#$mode & 8#022) == 0 || (8#$mode & 8#1000) != 0 )) ||
      refuse "$p above it is not root's, or others may rename its entries (uid $uid, mode $mode)"
    [ "$p" != / ] || break
    p=${p%/*}; p=${p:-/}
  done
}

# image_key: the cache key: what the image's contents depend on
image_key() {
  local torch pyver
  read -r pyver torch < <("$PY" -c 'import sys; from importlib.metadata import version
print(f"{sys.version_info[0]}.{sys.version_info[1]}", version("torch"))') ||
    die "$PY cannot report its torch version: run inside the project's environment (README)"
  # pip installs wheels for the caller's Python; Debian 12's python3 in the image is 3.11
  [ "$pyver" = 3.11 ] || die "$PY is Python $pyver; the image's Debian 12 python3 is 3.11: use a 3.11 venv" 2
  TORCH=$torch
  KEY=$( { cat -- "$0" "$REPO/pyproject.toml"; echo "torch==$TORCH"; } | sha256sum | cut -c1-16)
}

# remove_tree DIR: delete a (maybe half-built) image. A killed mmdebstrap can leave the host's /proc, /sys
# or /dev mounted inside: those are unmounted first, and rm never crosses into another file system.
remove_tree() {
  local mnt
  while read -r mnt; do umount -l -- "$mnt" || true; done < <(awk -v d="$1/" 'index($2, d) == 1 {print $2}' /proc/self/mounts | sort -r)
  rm -rf --one-file-system -- "$1"
}

# build: make CACHE/KEY (under the lock), and remove every other key's image
build() {
  local tmp site t0 mirror=()
  command -v mmdebstrap >/dev/null || die "mmdebstrap is not installed (scripts/test.sh installs it as root)"
  for old in "$CACHE"/.build-* "$CACHE"/*; do
    [[ -e $old && ( ${old##*/} =~ ^[0-9a-f]{16}(-oci-[0-9a-f]{8})?$ || ${old##*/} = .build-* ) && $old != "$CACHE/$KEY" ]] ||
      continue
    log "removing $old (an older or unfinished image)"; remove_tree "$old"
  done
  tmp=$(mktemp -d "$CACHE/.build-$KEY.XXXXXX")
  # the Debian mirror apt uses here, pasted as the image's sources (mmdebstrap reads an existing file so)
  [ ! -f /etc/apt/sources.list.d/debian.sources ] || mirror=(/etc/apt/sources.list.d/debian.sources)
  log "building $CACHE/$KEY: mmdebstrap (Debian 12 minbase + python3)"
  t0=$EPOCHREALTIME
  mmdebstrap --quiet --mode=root --format=directory --variant=minbase --include=python3 \
    bookworm "$tmp" "${mirror[@]}" </dev/null >&2
  log "mmdebstrap: $(elapsed "$t0") s"
  chmod 755 "$tmp"
  site=$tmp/usr/local/lib/python3.11/dist-packages
  log "pip: torch==$TORCH and $REPO with its dependencies into $site"
  t0=$EPOCHREALTIME
  "$PY" -m pip install -qq --no-input --no-warn-script-location --target "$site" "torch==$TORCH" "$REPO" >&2
  # console scripts: their shebang is the caller's venv python, which the image lacks
  rm -rf -- "$site/bin"
  log "pip: $(elapsed "$t0") s; image: $(du -sh "$tmp" | cut -f1)"
  # ch-run binds the host's /etc/hosts (the nodes' names: the ranks' rendezvous) only onto a file the image has
  touch "$tmp/etc/hosts"
  mv -T -- "$tmp" "$CACHE/$KEY"
}

# crun's host preparation (prepare_cgroups), shared with scripts/local-slurm.sh
. "$REPO/scripts/crun-cgroups.sh"

# elapsed T0: seconds since $EPOCHREALTIME was T0
elapsed() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

# write_containers_conf: podman as root sets nofile and nproc to 1048576 in every container, and crun's
# setrlimit fails where they exceed the hard limits podman runs with and the VM lacks CAP_SYS_RESOURCE to
# raise them ("setrlimit `RLIMIT_NOFILE`: Operation not permitted"). default_ulimits at those hard limits
# fixes it without any flag (`-1`, "the caller's maximum", means unlimited as root: refused too). nofile is
# the caller's hard limit (podman's own); nproc the caller's capped at pid_max (measured here: podman and
# conmon run with nproc 32768, pid_max, below the caller's 96362). The file is CACHE's, not
# /etc's; podman reads it where CONTAINERS_CONF names it, in place of the system's containers.conf (Debian's
# holds only the compiled-in defaults). Rewritten only when its text changes.
write_containers_conf() {
  local nofile nproc pid_max text
  nofile=$(ulimit -Hn) nproc=$(ulimit -Hu) pid_max=$(cat /proc/sys/kernel/pid_max)
  [ "$nofile" != unlimited ] || nofile=1048576
  if [ "$nproc" = unlimited ] || [ "$nproc" -gt "$pid_max" ]; then nproc=$pid_max; fi
  text=$(printf '# written by scripts/test-image.sh: podman here needs ulimits within its own hard limits\n[containers]\ndefault_ulimits = ["nofile=%s:%s", "nproc=%s:%s"]' \
    "$nofile" "$nofile" "$nproc" "$nproc")
  CONF=$CACHE/containers.conf
  if [ "$(cat -- "$CONF" 2>/dev/null)" != "$text" ]; then
    printf '%s\n' "$text" > "$CONF.tmp"; mv -f -- "$CONF.tmp" "$CONF"
  fi
}

# podman_image: the rootfs as localhost/gpujobs-test:KEY in podman's storage (imported when missing;
# the other keys' tags are removed then)
podman_image() {
  local t0 old
  command -v podman >/dev/null || die "podman is not installed (scripts/test.sh installs podman and crun as root)"
  NAME=localhost/gpujobs-test:$KEY
  export CONTAINERS_CONF=$CONF
  podman image exists "$NAME" && return 0
  log "podman import $NAME"
  t0=$EPOCHREALTIME
  tar -C "$CACHE/$KEY" -c . | podman import --quiet - "$NAME" >/dev/null
  log "podman import: $(elapsed "$t0") s"
  for old in $(podman images --format '{{.Repository}}:{{.Tag}}' localhost/gpujobs-test); do
    [ "$old" = "$NAME" ] || podman rmi "$old" >/dev/null || log "could not remove $old"
  done
}

# oci_bundle: the image as an OCI bundle for Slurm's `srun --container` with crun, for this checkout (the
# bundle mounts it): BUNDLE=CACHE/KEY-oci-H (H: a hash of REPO; removed with the image when the key changes)
# holding rootfs -> KEY (Slurm 22.05 runs BUNDLE/rootfs whatever config.json says) and config.json from
# `crun spec`, edited: the rootfs read-only, no terminal, the host's pid and network namespaces and hostname
# (the ranks' pids are host pids: the watchdog and the heartbeats use them; the ranks meet on the nodes'
# addresses), no rlimits of its own (the step's stay), /tmp, /etc/hosts (read-only) and the checkout
# bind-mounted at their own paths, the checkout as the working directory (Slurm 22.05 writes the step's argv
# and environment into config.json, not its working directory). Rewritten only when its text changes.
oci_bundle() {
  local spec text
  command -v crun >/dev/null || die "crun is not installed (scripts/test.sh installs it as root)"
  BUNDLE=$CACHE/$KEY-oci-$(printf '%s' "$REPO" | sha256sum | cut -c1-8)
  mkdir -p -- "$BUNDLE"
  [ "$(readlink -- "$BUNDLE/rootfs" || true)" = "../$KEY" ] || ln -sfn -- "../$KEY" "$BUNDLE/rootfs"
  spec=$(mktemp -d "$CACHE/.build-oci.XXXXXX")
  (cd "$spec" && crun spec) || die "crun spec failed"
  text=$("$PY" - "$spec/config.json" "$REPO" <<'PY'
import json
import sys

spec, repo = sys.argv[1:3]
with open(spec) as f:
    config = json.load(f)
config["root"] = {"path": "rootfs", "readonly": True}
config["process"].update(terminal=False, cwd=repo)
config["process"].pop("rlimits", None)
config.pop("hostname", None)
shared = {"pid", "network", "uts"}
config["linux"]["namespaces"] = [ns for ns in config["linux"]["namespaces"] if ns["type"] not in shared]
binds = [("/tmp", "rw"), ("/etc/hosts", "ro")] + ([] if (repo + "/").startswith("/tmp/") else [(repo, "rw")])
config["mounts"] += [{"destination": path, "type": "bind", "source": path, "options": ["rbind", mode]}
                     for path, mode in binds]
print(json.dumps(config, indent=2))
PY
  ) || die "could not edit crun's config.json"
  rm -rf -- "$spec"
  if [ "$(cat -- "$BUNDLE/config.json" 2>/dev/null)" != "$text" ]; then
    printf '%s\n' "$text" > "$BUNDLE/config.json.tmp"; mv -f -- "$BUNDLE/config.json.tmp" "$BUNDLE/config.json"
  fi
}

check_cache
image_key
exec 9>>"$CACHE/.lock"
# a warm call takes the lock too: it waits for a build in progress instead of starting a second one
flock 9
[ -d "$CACHE/$KEY" ] || build
# ch-run binds host paths only onto directories that exist in the (read-only) image, and binds /tmp by
# default: the checkout, mounted at its own path, needs its mount point in the image unless it is under
# /tmp. Made on every call (cheap, idempotent) since each checkout that uses the image has its own root.
# chroot: the path's symlinks resolve inside the image (its /var/run -> /run must not lead to the host's).
case $REPO/ in /tmp/*) ;; *) chroot "$CACHE/$KEY" mkdir -p -- "$REPO" ;; esac
# crun is podman's runtime and, in the Slurm tests, Slurm's OCI runtime: both need the cgroups prepared
prepare_cgroups || die "crun cannot run here: cgroup controllers are left on cgroup2 in hybrid mode"
if [ "$MODE" = podman ]; then
  write_containers_conf
  podman_image
  echo "CONTAINERS_CONF=$CONF"
  echo "$NAME"
elif [ "$MODE" = oci ]; then
  oci_bundle
  echo "$BUNDLE"
else
  echo "$CACHE/$KEY"
fi
