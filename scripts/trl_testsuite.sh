#!/usr/bin/env bash
# Runs TRL's own test suite (unmodified, from $TRL_TESTS, default ../shared/trl-tests/tests) offline against
# TRL as installed (--lib trl) or against posttrain through a `trl` -> `posttrain` import alias (--lib posttrain).
#
#   scripts/trl_testsuite.sh --lib trl|posttrain [--out DIR] [--sample FILE=K,...] [--select NODEIDS_FILE]
#                            [--timeout S] [-k EXPR] [--] [test files or node ids, relative to tests/ ...]
#   scripts/trl_testsuite.sh --ci      (CI: posttrain on every $TRL_SUITE_CI_EVERY-th test of the committed list of
#                                       tests that pass on TRL 1.16, scripts/trl_suite/trl_passing.txt; fails if one
#                                       outside scripts/trl_suite/known_differences.txt does not pass)
#
# Hub models and the zen dataset are offline stand-ins (scripts/trl_suite/standins.py, built once into
# $TRL_SUITE_CACHE, default .cache/trl_suite). The tests are copied to a temporary directory and run there, so nothing
# is written next to them. Results: DIR/<lib>.json (compare.py's input), DIR/<lib>.xml (JUnit), DIR/<lib>.log.
# Compare two runs: python scripts/trl_suite/compare.py DIR/trl.json DIR/posttrain.json
set -euo pipefail
# The body is one function, read whole before it runs: editing this file during a run cannot break the run.
main() {
  ROOT=$(cd "$(dirname "$0")/.." && pwd)
  cd "$ROOT"
  source scripts/env.sh
  PY=${PYTHON:-$ROOT/.venv/bin/python}
  [ -x "$PY" ] || PY=$(command -v python)
  TRL_TESTS=${TRL_TESTS:-$ROOT/../shared/trl-tests/tests}
  if [ ! -d "$TRL_TESTS" ]; then
    echo "trl_testsuite: TRL's tests are not at $TRL_TESTS; set TRL_TESTS to the tests/ folder of TRL's repository" >&2
    # CI without the reference folder fails: a parity stage that can silently not run is not a check.
    [[ " $* " == *" --ci "* ]] && echo "trl_testsuite: FAILED (--ci): no TRL tests to run; CI needs TRL's repository" \
      "tests at ../shared/trl-tests/tests (or TRL_TESTS)" >&2
    exit 2
  fi
  export TRL_SUITE_CACHE=${TRL_SUITE_CACHE:-$ROOT/.cache/trl_suite}

  LIB=trl
  OUT=$TRL_SUITE_CACHE/results
  # The issue's files; the big trainer files are sampled (every K-th test in collection order) so a run fits.
  SAMPLE="test_sft_trainer.py=8,test_dpo_trainer.py=8,test_grpo_trainer.py=10,test_rloo_trainer.py=8,\
  test_kto_trainer.py=6,test_reward_trainer.py=5,test_chat_template_utils.py=3"
  SELECT=""
  TIMEOUT=300
  FILES=()
  CI=0
  KEXPR=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --ci) CI=1; shift ;;
      --lib) LIB=$2; shift 2 ;;
      --out) OUT=$2; shift 2 ;;
      --sample) SAMPLE=$2; shift 2 ;;
      --select) SELECT=$(cd "$(dirname "$2")" && pwd)/$(basename "$2"); shift 2 ;;
      --timeout) TIMEOUT=$2; shift 2 ;;
    -k) KEXPR=$2; shift 2 ;;
      --) shift; FILES+=("$@"); break ;;
      *) FILES+=("$1"); shift ;;
    esac
  done
  case "$LIB" in trl|posttrain) ;; *) echo "--lib must be trl or posttrain" >&2; exit 2 ;; esac
  if [ "$CI" = 1 ]; then
    LIB=posttrain
    OUT=$TRL_SUITE_CACHE/ci
    mkdir -p "$OUT"
    SELECT=$OUT/selected.txt
    grep -v '^#' scripts/trl_suite/trl_passing.txt | awk -v k="${TRL_SUITE_CI_EVERY:-1}" 'NF && (n++ % k == 0)' >"$SELECT"
    SAMPLE=""
    FILES=()
    while read -r f; do FILES+=("${f#tests/}"); done < <(cut -d: -f1 "$SELECT" | sort -u)
  fi
  if [ ${#FILES[@]} -eq 0 ]; then
    FILES=(test_sft_trainer.py test_dpo_trainer.py test_reward_trainer.py test_kto_trainer.py test_grpo_trainer.py
           test_rloo_trainer.py test_data_utils.py test_chat_template_utils.py test_rewards.py test_callbacks.py
           test_utils.py test_model_utils.py test_cli.py experimental)
  fi
  mkdir -p "$OUT"
  OUT=$(cd "$OUT" && pwd)

  # Stand-ins: built in a process of their own, without the alias (they read the vendor chat templates that the
  # installed trl ships). Idempotent.
  PYTHONPATH="$ROOT/scripts/trl_suite" "$PY" "$ROOT/scripts/trl_suite/standins.py" "$TRL_SUITE_CACHE"

  WORK=$(mktemp -d "${TMPDIR:-/tmp}/trl_suite.XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
  cp -r "$TRL_TESTS" "$WORK/tests"

  export HF_HUB_CACHE=$TRL_SUITE_CACHE/hub HF_DATASETS_CACHE=$WORK/datasets_cache
  export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false PYTHONDONTWRITEBYTECODE=1
  export WANDB_MODE=disabled WANDB_DISABLED=true TRL_SUITE_LIB=$LIB
  if [ "$LIB" = posttrain ]; then
    # alias_site/sitecustomize.py: subprocesses resolve trl to posttrain too. The checkout's posttrain comes first.
    export PYTHONPATH="$ROOT/scripts/trl_suite/alias_site:$ROOT/scripts/trl_suite:$ROOT"
  else
    export PYTHONPATH="$ROOT/scripts/trl_suite"
  fi

  ARGS=()
  for f in "${FILES[@]}"; do ARGS+=("tests/$f"); done
  SEL=()
  [ -n "$SELECT" ] && SEL=(--trl-select "$SELECT")
  [ -n "$KEXPR" ] && SEL+=(-k "$KEXPR")
  cd "$WORK"
  set +e
  "$PY" -m pytest -p trl_suite_plugin -p no:cacheprovider --rootdir "$WORK" --continue-on-collection-errors -q -rN --color=no -o addopts="" \
    --trl-sample "$SAMPLE" "${SEL[@]}" --trl-timeout "$TIMEOUT" --trl-json "$OUT/$LIB.json" \
    --junitxml "$OUT/$LIB.xml" "${ARGS[@]}" >"$OUT/$LIB.log" 2>&1
  rc=$?
  set -e
  tail -n 1 "$OUT/$LIB.log"
  echo "trl_testsuite: --lib $LIB: results in $OUT/$LIB.json (pytest exit $rc)"
  if [ "$CI" = 1 ]; then
    cd "$ROOT"
    "$PY" scripts/trl_suite/compare.py "$SELECT" "$OUT/$LIB.json" --known scripts/trl_suite/known_differences.txt --check
  fi
}
main "$@"
exit
