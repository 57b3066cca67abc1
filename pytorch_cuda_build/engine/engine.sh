#!/usr/bin/env bash
# Make a Docker engine answer on this machine, and start containers, or say clearly why not.
#
# Our build hosts start with only a Docker client. As root on Debian we install
# Debian's docker.io and start dockerd; anywhere else we stop with a message,
# because installing an engine is the machine owner's decision, not ours.
# Also installs mmdebstrap (local base images, pytorch_cuda_build/stages/base.py), and docker-registry, skopeo and zstd (publish
# tests; publish reads the registry back with skopeo, and compresses zstd layers), Slurm's daemons, munge, umoci and runc (the
# Slurm test), podman, sudo and uidmap (the workflow
# replay) when asked with --with-registry.
#
# Sourcing this file defines its functions without running anything (the unit tests
# run check_bridge against a fake `ip` and `docker` that way).
set -euo pipefail

log=${PYTORCH_CUDA_DOCKERD_LOG:-/var/log/pytorch-cuda-dockerd.log}
pidfile=/var/run/docker.pid
# The pid of a dockerd this script started: only that one is ours to restart.
marker=/var/run/pytorch-cuda-dockerd.pid

say() { printf 'engine: %s\n' "$*" >&2; }
answers() { timeout 10 docker info >/dev/null 2>&1; }

# A process that exists and is not a zombie (a killed daemon stays one until reaped).
alive() {
  [ -n "$1" ] && kill -0 "$1" 2>/dev/null && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null
}
# The default engine's dockerd, starting or up: the one its pid file names, or one that will
# write that file (no --pidfile of its own). A second engine beside it (`build.py engine`
# runs Docker 26 with its own --pidfile) is not it: counting that one, a restart here waited
# for an answer that never came and started nothing.
dockerd_running() {
  local p args
  p=$(cat "$pidfile" 2>/dev/null || true)
  alive "$p" && return 0
  for p in $(pgrep -x dockerd 2>/dev/null); do
    alive "$p" || continue
    args=$(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null) || continue
    case " $args" in *" --pidfile"* | *" -p "*) continue ;; esac
    return 0
  done
  return 1
}
started_by_us() {
  local p
  p=$(cat "$marker" 2>/dev/null || true)
  alive "$p" && [ "$(cat "/proc/$p/comm" 2>/dev/null)" = dockerd ]
}

# A daemon killed with its session leaves its pid file; a new dockerd then refuses
# to start. Remove it only when the process it names is gone.
remove_stale_pidfile() {
  local pid
  if [ -f "$pidfile" ]; then
    pid=$(cat "$pidfile" 2>/dev/null || true)
    if ! alive "$pid"; then
      say "removing stale $pidfile (pid ${pid:-?} is gone)"
      rm -f "$pidfile"
    fi
  fi
  [ -S /var/run/containerd/containerd.sock ] || rm -f /var/run/docker/containerd/containerd.pid 2>/dev/null || true
}

start_dockerd() {
  say "starting dockerd (log: $log)"
  # Fully detached: a daemon holding our stdout/stderr would keep CI's pipe open.
  # Without job control the background child is no group leader, so setsid and nohup
  # exec in place and $! is dockerd's own pid.
  setsid nohup dockerd >"$log" 2>&1 </dev/null &
  echo $! >"$marker"
}

stop_dockerd() {
  local p _
  p=$(cat "$marker" 2>/dev/null || true)
  [ -n "$p" ] || return 1
  kill -TERM "$p" 2>/dev/null || true
  for _ in $(seq 1 30); do alive "$p" || break; sleep 1; done
  if alive "$p"; then say "dockerd (pid $p) did not stop within 30 s"; return 1; fi
  rm -f "$marker"
}

restart_dockerd() { stop_dockerd && remove_stale_pidfile && start_dockerd; }

wait_answers() {
  local _
  for _ in $(seq 1 60); do answers && return 0; sleep 1; done
  return 1
}

# The bridge the daemon attaches containers to: docker0 unless dockerd runs with
# --bridge=NAME; nothing when it has no bridge network at all (--bridge=none).
bridge_name() {
  local name
  name=$(docker network inspect bridge --format '{{index .Options "com.docker.network.bridge.name"}}' 2>/dev/null) || return 0
  if [ -z "$name" ] || [ "$name" = "<no value>" ]; then name=docker0; fi
  printf '%s\n' "$name"
}
link_exists() {
  if command -v ip >/dev/null 2>&1; then ip link show "$1" >/dev/null 2>&1; else [ -e "/sys/class/net/$1" ]; fi
}

# A daemon can answer and still start no container: a second dockerd started with
# --bridge=none deleted docker0 here, and every start then failed with "could not find
# bridge docker0" (the container stays behind, Created). dockerd recreates its bridge
# when it starts, so a daemon we started is restarted; anyone else's we only report.
check_bridge() {
  local name
  name=$(bridge_name)
  if [ -z "$name" ] || link_exists "$name"; then return 0; fi
  if started_by_us; then
    say "the Docker daemon's bridge $name is gone; restarting the dockerd this script started (pid $(cat "$marker"))"
    if restart_dockerd && wait_answers && link_exists "$name"; then say "Docker Engine is up, bridge $name back"; return 0; fi
  fi
  say "the Docker daemon answers but its bridge $name is gone; restart dockerd"
  return 3
}

# Images for another architecture (build --platform linux/arm64 on an x86-64 host): QEMU's
# user-mode emulator registered with binfmt_misc. Debian's qemu-user-static registers it with
# the F flag: the kernel opens the interpreter once, so containers and BuildKit's RUN steps find
# it without a copy inside. binfmt_misc is not mounted on every machine (a fresh VM here).
emulation() {
  local arch=${1:-aarch64}
  local entry=/proc/sys/fs/binfmt_misc/qemu-$arch
  # mmdebstrap checks with arch-test that a foreign architecture runs before it bootstraps one
  # (the base rootfs, pytorch_cuda_build/stages/base.py).
  if [ "$(id -u)" = 0 ] && ! command -v arch-test >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    say "installing arch-test (apt): mmdebstrap checks a foreign architecture with it"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends arch-test >/dev/null || true
  fi
  if [ -r "$entry" ] && grep -qx enabled "$entry" && grep -q '^flags: .*F' "$entry"; then return; fi
  if [ "$(id -u)" != 0 ]; then
    say "QEMU's $arch emulator is not registered with flag F (binfmt_misc); as root: apt-get install qemu-user-static binfmt-support, then update-binfmts --enable"
    exit 3
  fi
  local need=()
  command -v "qemu-$arch-static" >/dev/null 2>&1 || need+=(qemu-user-static)
  command -v update-binfmts >/dev/null 2>&1 || need+=(binfmt-support)
  if [ ${#need[@]} -gt 0 ]; then
    if ! command -v apt-get >/dev/null 2>&1; then
      say "need ${need[*]} for $arch emulation but this is not a Debian-like system; register QEMU with binfmt_misc yourself"
      exit 3
    fi
    say "installing ${need[*]} (apt) for $arch emulation"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
  if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  fi
  update-binfmts --enable "qemu-$arch" >/dev/null 2>&1 || update-binfmts --enable
  if ! { [ -r "$entry" ] && grep -qx enabled "$entry" && grep -q '^flags: .*F' "$entry"; }; then
    say "registering QEMU's $arch emulator failed: $entry is missing, disabled or lacks flag F"
    exit 3
  fi
  say "QEMU's $arch emulator registered (binfmt_misc, flag F)"
}

main() {
  if [ "${1:-}" = "--emulation" ]; then emulation "${2:-aarch64}"; return; fi
  local want_registry=0
  [ "${1:-}" = "--with-registry" ] && want_registry=1

  local need_pkgs=()
  if ! command -v dockerd >/dev/null 2>&1; then need_pkgs+=(docker.io); fi
  if ! command -v mmdebstrap >/dev/null 2>&1; then need_pkgs+=(mmdebstrap); fi
  if ! command -v objdump >/dev/null 2>&1; then need_pkgs+=(binutils); fi
  if [ "$want_registry" = 1 ] && [ ! -x /usr/bin/docker-registry ]; then need_pkgs+=(docker-registry); fi
  if [ "$want_registry" = 1 ] && ! command -v skopeo >/dev/null 2>&1; then need_pkgs+=(skopeo); fi
  # publish --sign-key signs with GnuPG (tests/integration/test_signing.py).
  if [ "$want_registry" = 1 ] && ! command -v gpg >/dev/null 2>&1; then need_pkgs+=(gnupg); fi
  # publish --compression zstd compresses each layer with it (tests/integration/test_zstd_registry.py).
  if [ "$want_registry" = 1 ] && ! command -v zstd >/dev/null 2>&1; then need_pkgs+=(zstd); fi
  # The workflow replay's runner user (tests/integration/test_workflow_replay.py) has sudo, as a hosted runner's does.
  if [ "$want_registry" = 1 ] && ! command -v sudo >/dev/null 2>&1; then need_pkgs+=(sudo); fi
  # ... and, without sudo, builds the base with mmdebstrap in a user namespace (newuidmap is uidmap's).
  if [ "$want_registry" = 1 ] && ! command -v newuidmap >/dev/null 2>&1; then need_pkgs+=(uidmap); fi
  # The host-list parser of pytorch-cuda-launch is checked against Slurm's own scontrol.
  if [ "$want_registry" = 1 ] && ! command -v scontrol >/dev/null 2>&1; then need_pkgs+=(slurm-client); fi
  # The sbatch scripts `build.py job` writes are checked with shellcheck.
  if [ "$want_registry" = 1 ] && ! command -v shellcheck >/dev/null 2>&1; then need_pkgs+=(shellcheck); fi
  # A two-node Slurm cluster runs the generated sbatch script through srun --container (runc),
  # on a bundle made with umoci (tests/slurm.py, tests/integration/test_slurm.py).
  if [ "$want_registry" = 1 ] && ! command -v slurmctld >/dev/null 2>&1; then need_pkgs+=(slurmctld); fi
  if [ "$want_registry" = 1 ] && ! command -v slurmd >/dev/null 2>&1; then need_pkgs+=(slurmd); fi
  if [ "$want_registry" = 1 ] && ! command -v munged >/dev/null 2>&1; then need_pkgs+=(munge); fi
  if [ "$want_registry" = 1 ] && ! command -v umoci >/dev/null 2>&1; then need_pkgs+=(umoci); fi
  if [ "$want_registry" = 1 ] && ! command -v runc >/dev/null 2>&1; then need_pkgs+=(runc); fi
  # The image under rootless Podman (tests/integration/test_podman.py).
  if [ "$want_registry" = 1 ] && ! command -v podman >/dev/null 2>&1; then need_pkgs+=(podman); fi

  if answers && [ ${#need_pkgs[@]} -eq 0 ]; then
    if [ "$want_registry" = 1 ] && [ "$(uname -m)" = x86_64 ]; then emulation aarch64; fi
    check_bridge; return
  fi

  if [ "$(id -u)" != 0 ]; then
    if answers; then
      say "missing ${need_pkgs[*]}; install them (Debian: apt-get install ${need_pkgs[*]})"
    else
      say "no Docker daemon answers at ${DOCKER_HOST:-unix:///var/run/docker.sock} and we are not root; start Docker Engine (or set DOCKER_HOST) and retry"
    fi
    exit 3
  fi
  if ! command -v apt-get >/dev/null 2>&1 && [ ${#need_pkgs[@]} -gt 0 ]; then
    say "need ${need_pkgs[*]} but this is not a Debian-like system; install Docker Engine and mmdebstrap yourself"
    exit 3
  fi

  if [ ${#need_pkgs[@]} -gt 0 ]; then
    say "installing ${need_pkgs[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    # The registry package must not start a service: we run it ourselves on 127.0.0.1.
    apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" iptables >/dev/null
  fi

  # The test suite builds and starts the arm64 base (tests/integration/test_arm64.py).
  if [ "$want_registry" = 1 ] && [ "$(uname -m)" = x86_64 ]; then emulation aarch64; fi

  if answers; then check_bridge; return; fi

  remove_stale_pidfile
  if ! dockerd_running; then start_dockerd; fi
  if wait_answers; then say "Docker Engine is up"; check_bridge; return; fi
  say "dockerd did not answer within 60 s; see $log:"
  tail -n 5 "$log" >&2 || true
  exit 3
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then main "$@"; fi
