#!/usr/bin/env bash
# Builds a Debian bookworm base image with Python 3.11 and venv from Debian packages alone, for hosts
# that cannot pull python:3.11-slim-bookworm from a registry. Equivalent for our purpose: the same
# Debian release and Python minor version; the stage images only need `python3 -m venv`.
#   usage: build-base.sh IMAGE:TAG
set -euo pipefail
image=${1:?usage: build-base.sh IMAGE:TAG}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
suite=bookworm

if docker image inspect "$image" >/dev/null 2>&1; then
  echo "base image $image already exists"
  exit 0
fi
command -v debootstrap >/dev/null || {
  echo "error: debootstrap not found; run \`make setup\` (or apt-get install debootstrap), or use BASE_IMAGE=python:3.11-slim-bookworm where a registry answers" >&2
  exit 1
}
root=$(mktemp -d /tmp/g4v69-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "debootstrap $suite from $mirror into $root"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$suite" "$root" "$mirror" >"$root.log" 2>&1 || {
  tail -20 "$root.log" >&2; echo "error: debootstrap failed (log above)" >&2; exit 1; }
rm -f "$root.log"
# Package lists, caches and logs would only make the image bigger and less repeatable.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb "$root"/var/log/*
tar -C "$root" --numeric-owner --sort=name -c . |
  docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$image" >/dev/null
echo "built base image $image"
