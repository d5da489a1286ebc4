#!/usr/bin/env bash
# What a fresh Debian/Ubuntu host needs before `make demo` and `make test` with RUNNER=docker:
#   host-setup.sh tools    install the missing host tools (docker.io, debootstrap, make) with apt-get
#   host-setup.sh engine   start dockerd when no Docker engine answers
#   host-setup.sh tools --dry-run   print the install command instead of running it
# As root, or through sudo; otherwise it prints the one command that does it. `make setup` and the CI
# entry point (.ci/run) both run it.
set -euo pipefail
what=${1:?usage: host-setup.sh tools|engine [--dry-run]}
dry_run=${2:-}
# as_root WHY HOW COMMAND...: run COMMAND as root (directly or by sudo -n); with neither, say WHY
# could not be done and HOW the user does it, and stop.
as_root() {
  local why=$1 how=$2; shift 2
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo "$@"
  else
    echo "error: $why and no root or password-less sudo to do it; run:" >&2
    echo "  $how" >&2
    exit 1
  fi
}
case "$what" in
tools)
  need=()
  command -v docker >/dev/null || need+=(docker.io)
  command -v dockerd >/dev/null || need+=(docker.io)
  command -v debootstrap >/dev/null || need+=(debootstrap)
  command -v make >/dev/null || need+=(make)
  [ ${#need[@]} -eq 0 ] && { echo "host tools: docker, dockerd, debootstrap and make present"; exit 0; }
  pkgs=$(printf '%s\n' "${need[@]}" | sort -u | xargs)
  [ "$dry_run" = --dry-run ] && { echo "would run: apt-get install -y $pkgs"; exit 0; }
  rc=0
  as_root "missing host tools ($pkgs)" "sudo apt-get install -y $pkgs" \
    sh -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $pkgs >/dev/null" || rc=$?
  [ "$rc" -eq 0 ] || { echo "error: apt-get install $pkgs failed (exit $rc)" >&2; exit 1; }
  echo "host tools: installed $pkgs"
  ;;
engine)
  if docker info >/dev/null 2>&1; then
    echo "docker engine answering: $(docker version --format '{{.Server.Version}}')"
    exit 0
  fi
  log=${TMPDIR:-/tmp}/g4v69-dockerd.log
  as_root "no Docker engine answers" "sudo systemctl start docker   (or: sudo dockerd &; add yourself to the docker group)" \
    sh -c "nohup dockerd >'$log' 2>&1 &"
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && { echo "dockerd up: $(docker version --format '{{.Server.Version}}')"; exit 0; }
    sleep 1
  done
  tail -20 "$log" >&2 || true
  echo "error: dockerd did not start within 60 s (log above: $log)" >&2
  exit 1
  ;;
*)
  echo "error: host-setup.sh takes tools or engine, not $what" >&2
  exit 2
  ;;
esac
