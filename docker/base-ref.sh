#!/usr/bin/env bash
# BASE_IMAGE=auto: prints the base image the stage images build on. The official Python image where
# it is present; else the Debian-packages one (debootstrap) where that is present; else the official
# one, which `ensure-base.sh` pulls, or replaces by building the debootstrap one when no registry
# answers (the fallback `make test` takes, for every target).
#   usage: base-ref.sh OFFICIAL_IMAGE DEBOOTSTRAP_IMAGE
set -uo pipefail
official=${1:?usage: base-ref.sh OFFICIAL_IMAGE DEBOOTSTRAP_IMAGE}
debootstrap=${2:?usage: base-ref.sh OFFICIAL_IMAGE DEBOOTSTRAP_IMAGE}
if docker image inspect "$official" >/dev/null 2>&1; then
  echo "$official"
elif docker image inspect "$debootstrap" >/dev/null 2>&1; then
  echo "$debootstrap"
else
  echo "$official"
fi
