#!/usr/bin/env bash
# Names the wheelhouse folder of an image's Debian packages: they depend on the package list and
# on what the base image already has, so the key covers both.
#   usage: debs-key.sh NAME BASE_IMAGE
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
base_id=$(docker image inspect --format '{{.Id}}' "$2" 2>/dev/null) || {
  echo "error: base image $2 not found; run \`make base-image\` or pull it" >&2; exit 1; }
echo "$1-$( { cat "$here/$1/apt-packages.txt"; echo "$base_id"; } | sha256sum | cut -c1-16)"
