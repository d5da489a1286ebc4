#!/usr/bin/env bash
# Downloads an image's Debian packages (and whatever the base image lacks of their dependencies)
# into the wheelhouse, using apt inside the base image itself, so the set matches that base.
# This is the one step besides `pip download` that uses the network; the image build does not.
#   usage: fill-debs.sh NAME BASE_IMAGE WHEELHOUSE
set -euo pipefail
name=${1:?}; base=${2:?}; wheelhouse=${3:?}
here=$(cd "$(dirname "$0")" && pwd)
[ -f "$here/$name/apt-packages.txt" ] || exit 0
dest="$wheelhouse/debs/$("$here/debs-key.sh" "$name" "$base")"
if [ -f "$dest/.complete" ]; then
  echo "wheelhouse: Debian packages for $name complete, nothing to download"
  exit 0
fi
mkdir -p "$dest"
pkgs=$(grep -v '^#' "$here/$name/apt-packages.txt" | xargs)
echo "wheelhouse: downloading Debian packages for $name: $pkgs"
docker run --rm -v "$dest:/out" "$base" sh -c "
  apt-get update -qq && apt-get install -y -qq --no-install-recommends --download-only \
    -o Dir::Cache::archives=/out $pkgs >/dev/null && rm -f /out/lock && rm -rf /out/partial &&
  chown -R $(id -u):$(id -g) /out"
ls "$dest"/*.deb >/dev/null
(cd "$dest" && sha256sum ./*.deb > SHA256SUMS && touch .complete)
echo "wheelhouse: $(ls "$dest"/*.deb | wc -l) Debian packages for $name"
