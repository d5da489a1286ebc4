#!/usr/bin/env bash
# Builds one stage image offline from the wheelhouse, or reuses it when its tag already exists.
#   usage: build-image.sh NAME BASE_IMAGE WHEELHOUSE
# The build context is a temporary folder holding the Dockerfile, the lock, exactly the lock's
# wheels (hard links into the wheelhouse) and, for images with apt-packages.txt, the Debian
# packages downloaded by `make wheelhouse` for that base image. No secret is passed to the build.
set -euo pipefail
name=${1:?usage: build-image.sh NAME BASE_IMAGE WHEELHOUSE}
base=${2:?}
wheelhouse=${3:?}
here=$(cd "$(dirname "$0")" && pwd)
tag=$("$here/image-tag.sh" "$name" "$base")
# G4V69_BUILD_TAG builds a second, independent copy (no layer cache) under another tag: the
# reproducibility test compares what the two install.
no_cache=()
if [ -n "${G4V69_BUILD_TAG:-}" ]; then
  tag=$G4V69_BUILD_TAG
  no_cache=(--no-cache)
elif docker image inspect "$tag" >/dev/null 2>&1; then
  echo "image $tag: up to date (tag derives from its lock), reused" >&2
  exit 0
fi
if ! docker image inspect "$base" >/dev/null 2>&1; then
  echo "base image $base not present; pulling it" >&2
  docker pull "$base" >&2 || {
    echo "error: cannot pull $base (no registry reachable?); build a base from Debian packages instead:" >&2
    echo "  make base-image && make images BASE_IMAGE=debootstrap   (or export BASE_IMAGE=debootstrap)" >&2
    exit 1; }
fi
ctx=$(mktemp -d "${TMPDIR:-/tmp}/g4v69-ctx-$name.XXXXXX")
trap 'rm -rf "$ctx"' EXIT
cp "$here/stage.Dockerfile" "$ctx/Dockerfile"
cp "$here/$name/requirements.lock" "$ctx/requirements.lock"
python3 "$here/wheelhouse.py" context "$wheelhouse" "$here/$name/requirements.lock" "$ctx"
mkdir "$ctx/debs"
if [ -f "$here/$name/apt-packages.txt" ]; then
  debs="$wheelhouse/debs/$("$here/debs-key.sh" "$name" "$base")"
  [ -f "$debs/.complete" ] || { echo "error: no Debian packages for $name on $base in $debs; run \`make wheelhouse\` first" >&2; exit 1; }
  cp "$debs"/*.deb "$ctx/debs/" 2>/dev/null || true
fi
lock_sha=$(sha256sum "$here/$name/requirements.lock" | cut -d' ' -f1)
echo "image $tag: building from $base, $(ls "$ctx/wheels" | wc -l) wheels, $(ls "$ctx/debs" | wc -l) debs, no network"
start=$(date +%s)
# --network none: the build must not need the network; a missing wheel fails here, not silently.
docker build --network none --pull=false --force-rm "${no_cache[@]}" \
  --build-arg BASE_IMAGE="$base" --build-arg IMAGE_NAME="$name" --build-arg LOCK_SHA256="$lock_sha" \
  -t "$tag" "$ctx"
# The venv stage is only a means to keep the wheels out of the final layers.
docker image prune -f --filter label=org.g4v69.build-stage=venv >/dev/null
echo "image $tag: built in $(( $(date +%s) - start )) s"
