#!/usr/bin/env bash
# The main job: fine-tunes the built-in SmolLM2-135M-Instruct on GSM8K-style chain-of-thought solutions
# (reasoning-gym gsm_symbolic, shipped in examples/data/) through the `posttrain` command line, and
# reports held-out loss before and after training plus the run report (outputs/main_job/report.html).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
exec .venv/bin/posttrain sft --config examples/sft_smollm2.yaml "$@"
