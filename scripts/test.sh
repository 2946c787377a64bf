#!/usr/bin/env bash
# Run trl-harbor's tests (docs/testing.md).
#   scripts/test.sh [pytest args]         both tiers, the whole suite (bootstrapping the environment first): what CI runs
#   scripts/test.sh --fast [pytest args]  the fast tier alone: no root, no bubblewrap, no Docker, no image build;
#                                         tests marked local, docker, ray or slow are deselected, and a test that
#                                         starts a sandbox fails. The same as TRL_HARBOR_FAST_TIER=1 scripts/test.sh.
#                                         The local sandbox package's tests have their own switch, set too:
#                                         HARBOR_LOCAL_SANDBOX_TEST_TIER=fast.
#                                         It bootstraps only where .venv is missing (bootstrapping checks for the
#                                         sandbox's system packages, which the fast tier does not need).
set -euo pipefail
cd "$(dirname "$0")/.."
fast="${TRL_HARBOR_FAST_TIER:-0}"
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
if [ "$fast" = 0 ] || [ ! -x .venv/bin/python ]; then
  ./scripts/bootstrap.sh
fi
export HARBOR_TELEMETRY=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "$fast" != 0 ]; then
  # The marker expression as well: it holds where tests/conftest.py is not loaded (packages/*/tests run alone).
  export TRL_HARBOR_FAST_TIER=1 HARBOR_LOCAL_SANDBOX_TEST_TIER=fast
  exec .venv/bin/python -m pytest -m "not local and not docker and not ray and not slow" "$@"
fi
exec .venv/bin/python -m pytest "$@"
