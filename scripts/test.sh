#!/usr/bin/env bash
# Sets up .venv if needed, then runs the default test suite (slow tests excluded: `scripts/test.sh -m slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
