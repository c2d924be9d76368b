# scripts/crun-cgroups.sh -- sourced by scripts/test-image.sh (podman's crun) and scripts/local-slurm.sh (crun
# as Slurm's OCI runtime): the host preparation crun needs here. Defines functions only.

# prepare_cgroups: crun refuses a hybrid hierarchy where cgroup2 still holds a controller ("cgroups in
# hybrid mode not supported, drop all controllers from cgroupv2"); here hugetlb stays on cgroup2 while the
# others are v1. Mounting a v1 hierarchy of each such controller moves it off cgroup2. Only on a v1 or
# hybrid host (a pure cgroup2 host is fine as it is); idempotent. Returns 1 (after a line on stderr) when a
# controller could not be moved.
prepare_cgroups() {
  local c controllers=/sys/fs/cgroup/unified/cgroup.controllers
  [ "$(stat -fc %T /sys/fs/cgroup)" != cgroup2fs ] && [ -r "$controllers" ] || return 0
  for c in $(cat "$controllers"); do
    mountpoint -q "/sys/fs/cgroup/$c" && continue
    echo "crun-cgroups: mounting a cgroup v1 hierarchy for $c (crun refuses controllers left on cgroup2 in hybrid mode)" >&2
    mkdir -p "/sys/fs/cgroup/$c"
    # a failed mount is fine where a concurrent caller (test-image.sh beside local-slurm.sh) got there first
    mount -t cgroup -o "$c" cgroup "/sys/fs/cgroup/$c" || mountpoint -q "/sys/fs/cgroup/$c" ||
      { echo "crun-cgroups: could not move cgroup controller $c to v1" >&2; return 1; }
  done
}
