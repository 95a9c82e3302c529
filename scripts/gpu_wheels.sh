#!/usr/bin/env bash
# Downloads what benchmarks/gpu_check.py needs on the GPU machine and that machine lacks (it has torch 2.11 with
# CUDA 13, transformers 5.17, accelerate, peft, pyarrow, pandas and pytest, and no network), into gpu_wheels/
# (ignored by git; carried to the machine with the working tree, 64 MiB in all with the repository's ~5 MB).
#   scripts/gpu_wheels.sh                  # the wheels below (16.0 MB) and SmolLM2's tokenizer and config (3.5 MB)
# pyarrow is the machine's own: its wheel (55 MB for 26.0.1) would not fit beside these. gpu_check.py stops, saying
# so, if the machine's is older than 21.
# (the machine's tokenizers 0.23.2, huggingface-hub 1.33, safetensors 0.8 and typer fit transformers 5.24)
# posttrain itself travels as source (PYTHONPATH=$PWD), so no wheel of it is needed.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=gpu_wheels
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$DEST"
# The device machine's python is CPython 3.12 on x86-64 (manylinux).
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64)
wheels=(
  "transformers==5.24.0"   # posttrain needs >= 5.19; the machine has 5.17
  "peft==0.21.2"           # the version posttrain is tested with
  "trl==1.16.0"            # the reference run
  "datasets==4.8.4"        # posttrain's and TRL's trainers take datasets; 4.8 runs on pyarrow >= 21 (5.x needs 24)
  "dill==0.4.1"            # datasets' needs the machine lacks
  "multiprocess==0.70.19"
)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$DEST" "${wheels[@]}"
# SmolLM2-135M-Instruct's tokenizer and config (its 94 MB of weights do not fit: the check builds the model from the
# config with random weights, which times the same computation).
"$PY" - "$DEST" <<'PY'
import shutil, sys
from pathlib import Path
from posttrain.models.builtin import builtin_model_path
source, dest = Path(builtin_model_path()), Path(sys.argv[1]) / "smollm2"
dest.mkdir(exist_ok=True)
for item in source.iterdir():
    if not item.name.endswith((".safetensors", ".bin", ".gguf")):
        shutil.copy(item, dest / item.name)
PY
du -b "$DEST"/* | sort -n | awk '{printf "%8.1f MB  %s\n", $1/1e6, $2; total += $1} END {printf "%8.1f MB  total\n", total/1e6}'
