#!/usr/bin/env bash
# Runs TRL's example scripts (examples/scripts/*.py of TRL's repository, $TRL_EXAMPLES, default
# ../shared/trl-tests/examples/scripts) offline on tiny stand-ins, 2 steps each, with TRL 1.16 and with posttrain
# (the scripts' `trl` imports switched to `posttrain`), and writes the side-by-side table to
# docs/results/trl_examples.md (with --table). scripts/trl_suite/examples.py is the driver.
#
#   scripts/trl_examples.sh [--lib trl|posttrain|both] [--out DIR] [--table] [--timeout S] [script.py ...]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
source scripts/env.sh
PY=${PYTHON:-$ROOT/.venv/bin/python}
EXAMPLES=${TRL_EXAMPLES:-$ROOT/../shared/trl-tests/examples/scripts}
if [ ! -d "$EXAMPLES" ]; then
  echo "trl_examples: TRL's example scripts are not at $EXAMPLES; set TRL_EXAMPLES to examples/scripts of TRL's repository" >&2
  exit 2
fi
export TRL_SUITE_CACHE=${TRL_SUITE_CACHE:-$ROOT/.cache/trl_suite}
LIBS=(trl posttrain)
OUT=$TRL_SUITE_CACHE/examples
TABLE=0
TIMEOUT=600
SCRIPTS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --lib) [ "$2" = both ] || LIBS=("$2"); shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --table) TABLE=1; shift ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    *) SCRIPTS+=("$1"); shift ;;
  esac
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHONPATH="$ROOT/scripts/trl_suite" "$PY" "$ROOT/scripts/trl_suite/standins.py" "$TRL_SUITE_CACHE"
export HF_HUB_CACHE=$TRL_SUITE_CACHE/hub HF_DATASETS_CACHE=$OUT/datasets_cache
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled TRL_EXPERIMENTAL_SILENCE=1
export PYTHONPATH="$ROOT"  # the checkout's posttrain
rc=0
for lib in "${LIBS[@]}"; do
  "$PY" "$ROOT/scripts/trl_suite/examples.py" --examples "$EXAMPLES" --lib "$lib" --out "$OUT" --timeout "$TIMEOUT" \
    "${SCRIPTS[@]}" || rc=1
done
if [ "$TABLE" = 1 ]; then
  { echo "# TRL's example scripts on posttrain"; echo
    echo "TRL's \`examples/scripts/*.py\` (the repository commit of \`../shared/trl-tests\`), each run with TRL 1.16 and"
    echo "with its \`trl\` imports switched to \`posttrain\`, offline on tiny stand-ins. Regenerate with"
    echo "\`bash scripts/trl_examples.sh --table\`. Times are wall seconds of one run on a shared machine with other jobs"
    echo "running (start-up and data preparation included): not a speed comparison."; echo
    "$PY" "$ROOT/scripts/trl_suite/examples.py" --table "$OUT" "$(git rev-parse --short HEAD)"; } > docs/results/trl_examples.md
fi
exit $rc
