#!/usr/bin/env bash
# posttrain as a package (issue 44): build the wheel and sdist with `python -m build`, install the wheel (not
# editable) into a virtual environment of its own, then, from a scratch folder outside the repository, import
# posttrain, run the `posttrain` command, and run the README's quickstart on the tiny model.
#   bash scripts/wheel_check.sh        # what .ci/run's "wheel" stage runs
# The wheel's environment is .venv-wheel (WHEEL_VENV=... elsewhere): created and filled from the wheel's own
# requirements the first time (torch and the rest from the pip cache / local wheels, about 2-3 minutes), and
# reused afterwards, the wheel itself always reinstalled. CI starts from a fresh clone, so there it is always new.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
source scripts/env.sh
VENV=${POSTTRAIN_VENV:-.venv}
WHEEL_VENV=$(realpath -m "${WHEEL_VENV:-.venv-wheel}")
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

echo "wheel: build (sdist + wheel, no build isolation: setuptools from $VENV, no network)"
"$VENV/bin/python" -m build --no-isolation --outdir "$WORK/dist" . >"$WORK/build.log" 2>&1 || {
  tail -40 "$WORK/build.log"
  exit 1
}
wheel=$(ls "$WORK"/dist/posttrain-*.whl)
sdist=$(ls "$WORK"/dist/posttrain-*.tar.gz)
echo "wheel: built $(basename "$wheel") and $(basename "$sdist")"
# The sdist holds the package and its metadata; the wheel holds the package and nothing else of the repository.
tar tzf "$sdist" >"$WORK/sdist.txt"
grep -q '/posttrain/__init__.py$' "$WORK/sdist.txt"
unzip -Z1 "$wheel" >"$WORK/wheel.txt"
if grep -v -E '^(posttrain/|posttrain-[^/]+\.dist-info/)' "$WORK/wheel.txt"; then
  echo "wheel: files outside the package (above)" >&2
  exit 1
fi

echo "wheel: install into $WHEEL_VENV"
[ -x "$WHEEL_VENV/bin/python" ] || "$PY" -m venv "$WHEEL_VENV"
wpip() { "$WHEEL_VENV/bin/python" -m pip "$@"; }
# torch alone first (the CPU wheel on disk), then the wheel with its declared requirements, pinned as the
# development machines are (scripts/constraints.txt).
wpip install -q -c scripts/constraints.txt "torch==2.13.0" 2> >(grep -v 'is ignored' >&2)
wpip install -q --force-reinstall --no-deps "$wheel"
wpip install -q -c scripts/constraints.txt "$wheel" 2> >(grep -v 'is ignored' >&2)
wpip check

echo "wheel: import and run from outside the repository"
mkdir -p "$WORK/run/examples"
cp -r examples/data "$WORK/run/examples/data"
# The README's quickstart, as it is on the page (its first python block after "## Quickstart").
"$VENV/bin/python" - "$ROOT/README.md" "$WORK/run/quickstart.py" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
block = re.search(r"## Quickstart\n.*?```python\n(.*?)```", text, re.S).group(1)
open(sys.argv[2], "w").write(block)
PY
cd "$WORK/run"
export PYTHONPATH= POSTTRAIN_CACHE="$WORK/run/cache" HF_DATASETS_CACHE="$WORK/hf-datasets" OMP_NUM_THREADS=1 TQDM_DISABLE=1
"$WHEEL_VENV/bin/python" - "$ROOT" <<'PY'
import json, pathlib, sys

import posttrain

root = pathlib.Path(sys.argv[1]).resolve()
where = pathlib.Path(posttrain.__file__).resolve()
# Imported from the installed wheel (site-packages, which may sit inside the checkout in .venv-wheel), never from
# the source tree.
assert "site-packages" in where.parts and root / "posttrain" not in where.parents, f"posttrain imported from {where}"
assert all(pathlib.Path(path or ".").resolve() != root for path in sys.path), "the repository is on sys.path"
assert "site-packages" in str(where), where
print(f"wheel: posttrain {posttrain.__version__} from {where.parent}")

# The built-in model's name resolves to the tiny model put in the posttrain cache (as the docs tests do).
from posttrain.models.tiny import save_tiny_model

model = pathlib.Path(save_tiny_model(pathlib.Path("cache") / "SmolLM2-135M-Instruct"))
config = json.loads((model / "config.json").read_text())
config["max_position_embeddings"] = 4096  # room for the quickstart's max_length under the byte-level tokenizer
(model / "config.json").write_text(json.dumps(config))
PY
"$WHEEL_VENV/bin/posttrain" --help >/dev/null
"$WHEEL_VENV/bin/python" quickstart.py
test -f outputs/sft/adapter_config.json -o -f outputs/sft/config.json
echo "wheel: the README quickstart ran from the installed wheel"
