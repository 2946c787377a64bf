#!/usr/bin/env bash
# The project's main job for now: check the bundled task suite in the local sandbox
# (every oracle solution scores 1, doing nothing scores 0). Extra arguments go to
# `trl-harbor check`, e.g. `--task orders_count` or `--environment-type docker`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
export HARBOR_TELEMETRY=0
exec .venv/bin/trl-harbor check examples/tasks "$@"
