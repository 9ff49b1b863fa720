#!/usr/bin/env bash
# Make sure a Docker engine answers, installing and starting one if needed.
# Fresh Debian machines of our kind have the docker client but no engine:
# install docker.io (and the image-building tools, and mkfs.ext4 for each run's
# disk), start dockerd as root,
# and wait for it with a deadline. Idempotent: quick when all is in place.
set -euo pipefail

DEADLINE_S=${ENGINE_DEADLINE_S:-90}
LOG=${DOCKERD_LOG:-/var/log/sandbox-dockerd.log}

need_pkgs=()
command -v dockerd >/dev/null 2>&1 || need_pkgs+=(docker.io)
command -v mmdebstrap >/dev/null 2>&1 || need_pkgs+=(mmdebstrap)
command -v sqlite3 >/dev/null 2>&1 || need_pkgs+=(sqlite3)
command -v iptables >/dev/null 2>&1 || need_pkgs+=(iptables)
command -v mkfs.ext4 >/dev/null 2>&1 || need_pkgs+=(e2fsprogs)   # each run's disk
command -v npm >/dev/null 2>&1 || need_pkgs+=(npm)   # fetches the guard's MCP servers on the host
if [ "${#need_pkgs[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "ensure-engine: need root to install ${need_pkgs[*]}" >&2; exit 2
  fi
  echo "ensure-engine: installing ${need_pkgs[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi

if docker info >/dev/null 2>&1; then
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "ensure-engine: the Docker engine does not answer and only root can start it" >&2; exit 2
fi
if ! pgrep -x dockerd >/dev/null 2>&1; then
  echo "ensure-engine: starting dockerd (log: $LOG)" >&2
  # A stale pid file from a killed engine stops a new one from starting.
  rm -f /var/run/docker.pid
  nohup dockerd >>"$LOG" 2>&1 </dev/null &
fi
end=$((SECONDS + DEADLINE_S))
until docker info >/dev/null 2>&1; do
  if [ "$SECONDS" -ge "$end" ]; then
    echo "ensure-engine: dockerd did not answer within ${DEADLINE_S}s; last log lines:" >&2
    tail -n 20 "$LOG" >&2 || true
    exit 2
  fi
  sleep 0.2
done
echo "ensure-engine: engine up ($(docker version --format '{{.Server.Version}}'))" >&2
