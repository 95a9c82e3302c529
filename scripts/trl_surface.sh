#!/usr/bin/env bash
# Regenerates tests/fixtures/trl_1.16_surface.json from trl==1.16.0 installed in a throwaway venv (TRL is never a
# dependency of posttrain).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/trl
python3 -m venv "$venv"
"$venv/bin/pip" install -q "torch==2.13.0"
"$venv/bin/pip" install -q -c scripts/constraints.txt "trl==1.16.0"
"$venv/bin/python" scripts/trl_surface.py tests/fixtures/trl_1.16_surface.json
rm -rf "$(dirname "$venv")"
