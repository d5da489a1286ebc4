#!/usr/bin/env bash
# Hosted-CI artifact job: builds genie_bundle/ for the default job (E2B on SM8450 unless SOC,
# COMPILER or MODEL_REVISION say otherwise). Secrets arrive as environment variables and are
# passed to containers by name only; they are never echoed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${HF_TOKEN:-}" ]; then
  echo "error: HF_TOKEN is not set; add it as a repository secret (an account that accepted the Gemma 4 license)" >&2
  exit 2
fi
if [ "${COMPILER:-local}" = aihub ] && [ -z "${QAI_HUB_API_TOKEN:-}" ]; then
  echo "error: COMPILER=aihub needs the QAI_HUB_API_TOKEN secret" >&2
  exit 2
fi
# Disk and memory first: a runner without room fails here, not hours in.
G4V69_SOC="${SOC:-}" G4V69_COMPILER="${COMPILER:-}" bash ci/check-runner.sh
make images
make plan
make bundle
make verify
ls -la genie_bundle/
