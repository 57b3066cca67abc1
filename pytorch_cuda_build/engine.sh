#!/usr/bin/env bash
# Make a Docker engine answer on this machine, or say clearly why we cannot.
#
# Our build hosts start with only a Docker client. As root on Debian we install
# Debian's docker.io and start dockerd; anywhere else we stop with a message,
# because installing an engine is the machine owner's decision, not ours.
# Also installs debootstrap (local base images) and docker-registry (publish tests)
# when asked with --with-registry.
set -euo pipefail

log=${PYTORCH_CUDA_DOCKERD_LOG:-/var/log/pytorch-cuda-dockerd.log}
pidfile=/var/run/docker.pid
want_registry=0
[ "${1:-}" = "--with-registry" ] && want_registry=1

say() { printf 'engine: %s\n' "$*" >&2; }
answers() { timeout 10 docker info >/dev/null 2>&1; }

need_pkgs=()
if ! command -v dockerd >/dev/null 2>&1; then need_pkgs+=(docker.io); fi
if ! command -v debootstrap >/dev/null 2>&1; then need_pkgs+=(debootstrap); fi
if ! command -v objdump >/dev/null 2>&1; then need_pkgs+=(binutils); fi
if [ "$want_registry" = 1 ] && [ ! -x /usr/bin/docker-registry ]; then need_pkgs+=(docker-registry); fi

if answers && [ ${#need_pkgs[@]} -eq 0 ]; then exit 0; fi

if [ "$(id -u)" != 0 ]; then
  if answers; then
    say "missing ${need_pkgs[*]}; install them (Debian: apt-get install ${need_pkgs[*]})"
  else
    say "no Docker daemon answers at ${DOCKER_HOST:-unix:///var/run/docker.sock} and we are not root; start Docker Engine (or set DOCKER_HOST) and retry"
  fi
  exit 3
fi
if ! command -v apt-get >/dev/null 2>&1 && [ ${#need_pkgs[@]} -gt 0 ]; then
  say "need ${need_pkgs[*]} but this is not a Debian-like system; install Docker Engine and debootstrap yourself"
  exit 3
fi

if [ ${#need_pkgs[@]} -gt 0 ]; then
  say "installing ${need_pkgs[*]} (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  # The registry package must not start a service: we run it ourselves on 127.0.0.1.
  apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" iptables >/dev/null
fi

if answers; then exit 0; fi

# A process that exists and is not a zombie (a killed daemon stays one until reaped).
alive() {
  [ -n "$1" ] && kill -0 "$1" 2>/dev/null && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null
}
dockerd_running() {
  local p
  for p in $(pgrep -x dockerd 2>/dev/null); do alive "$p" && return 0; done
  return 1
}

# A daemon killed with its session leaves its pid file; a new dockerd then refuses
# to start. Remove it only when the process it names is gone.
if [ -f "$pidfile" ]; then
  pid=$(cat "$pidfile" 2>/dev/null || true)
  if ! alive "$pid"; then
    say "removing stale $pidfile (pid ${pid:-?} is gone)"
    rm -f "$pidfile"
  fi
fi
[ -S /var/run/containerd/containerd.sock ] || rm -f /var/run/docker/containerd/containerd.pid 2>/dev/null || true

if ! dockerd_running; then
  say "starting dockerd (log: $log)"
  # Fully detached: a daemon holding our stdout/stderr would keep CI's pipe open.
  setsid nohup dockerd >"$log" 2>&1 </dev/null &
fi
for _ in $(seq 1 60); do
  if answers; then say "Docker Engine is up"; exit 0; fi
  sleep 1
done
say "dockerd did not answer within 60 s; see $log:"
tail -n 5 "$log" >&2 || true
exit 3
