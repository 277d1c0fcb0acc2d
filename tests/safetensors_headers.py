"""Raw safetensors header edits for the checkpoint tests (``test_serialization.py``,
``test_transformers.py``): what a damaged or tampered file looks like to a loader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def edit_tensor_entry(file: Path, name: str, **changes: Any) -> None:
    """Rewrite one tensor's entry (``dtype``, ``shape``) in the raw safetensors JSON header of
    ``file``, leaving the tensor bytes and the kbit header metadata as they are."""
    data = file.read_bytes()
    n = int.from_bytes(data[:8], "little")
    entries = json.loads(data[8 : 8 + n])
    entries[name].update(changes)
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes
    file.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])
