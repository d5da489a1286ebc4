#!/usr/bin/env bash
# Prints the tag of a stage image: g4v69-NAME:<hash>, the hash over what the image is built from
# (its lock, its Debian package list, the shared Dockerfile and the base image reference), so an
# unchanged image is reused and a changed lock can never be mistaken for an old image.
#   usage: image-tag.sh NAME BASE_IMAGE
set -euo pipefail
name=${1:?usage: image-tag.sh NAME BASE_IMAGE}
base=${2:?usage: image-tag.sh NAME BASE_IMAGE}
here=$(cd "$(dirname "$0")" && pwd)
[ -f "$here/$name/requirements.lock" ] || { echo "error: no image named $name (docker/$name/requirements.lock missing)" >&2; exit 1; }
hash=$( {
  cat "$here/stage.Dockerfile" "$here/$name/requirements.lock"
  [ -f "$here/$name/apt-packages.txt" ] && cat "$here/$name/apt-packages.txt"
  printf '%s\n' "$base"
} | sha256sum | cut -c1-16)
echo "g4v69-$name:$hash"
