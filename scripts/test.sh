#!/usr/bin/env bash
# Run trl-harbor's whole test suite (bootstrapping the environment first).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
export HARBOR_TELEMETRY=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest "$@"
