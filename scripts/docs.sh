#!/usr/bin/env bash
# The documentation site (mkdocs-material, from docs/ and the docstrings; configuration in mkdocs.yml).
#   bash scripts/docs.sh          # set-up if needed, build into site/, then serve a live preview at http://127.0.0.1:8000
#   bash scripts/docs.sh build    # build only (what .ci/run does); strict: a broken link or reference fails
# DOCS_ADDR=host:port changes where the preview listens.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
VENV=${POSTTRAIN_VENV:-.venv}
export NO_MKDOCS_2_WARNING=1
"$VENV/bin/python" -m mkdocs build --strict
if [ "${1:-serve}" = build ]; then
  exit 0
fi
exec "$VENV/bin/python" -m mkdocs serve --strict --dev-addr "${DOCS_ADDR:-127.0.0.1:8000}"
