#!/usr/bin/env bash
# BASE_IMAGE=auto: makes sure a base image is present before the stage images are built. Nothing to do
# when the official or the debootstrap base is there; else pull the official one, and where that fails
# (no registry reachable) build the debootstrap one from Debian packages.
#   usage: ensure-base.sh OFFICIAL_IMAGE DEBOOTSTRAP_IMAGE
set -euo pipefail
official=${1:?usage: ensure-base.sh OFFICIAL_IMAGE DEBOOTSTRAP_IMAGE}
debootstrap=${2:?usage: ensure-base.sh OFFICIAL_IMAGE DEBOOTSTRAP_IMAGE}
here=$(cd "$(dirname "$0")" && pwd)
for image in "$official" "$debootstrap"; do
  docker image inspect "$image" >/dev/null 2>&1 && exit 0
done
echo "base image: pulling $official" >&2
if timeout "${G4V69_PULL_TIMEOUT_S:-300}" docker pull "$official" >&2; then
  exit 0
fi
echo "base image: cannot pull $official (no registry reachable?); building $debootstrap from Debian packages instead" >&2
exec "$here/base/build-base.sh" "$debootstrap" >&2
