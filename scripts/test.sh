#!/usr/bin/env bash
# Sets up .venv if needed, then runs the default test suite (slow tests excluded: `scripts/test.sh -m slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
