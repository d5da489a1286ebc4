#!/usr/bin/env bash
# Hosted-CI test job: the images from the registry's python:3.11-slim-bookworm base, then make test.
set -euo pipefail
cd "$(dirname "$0")/.."
export G4V69_REQUIRE_DOCKER=1
make wheelhouse
make images
make venv
make test
