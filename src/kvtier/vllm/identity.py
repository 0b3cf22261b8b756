"""The model identity in the chunk keys of KV that vLLM computed: ``vllm_model_id``.

Every vLLM instance serving the same weights must derive the same identity, wherever its
folder lies, so that instances on one shared tier reuse each other's KV: it is a digest of
``config.json`` and of every safetensors file's header (tensor names, dtypes, shapes and
offsets) and first bytes of data, not of the path. A model vLLM names without a local
folder (a hub id) falls back to the name and revision. The readable part is the config's
``model_type``.

The identity starts with ``vllm-``: vLLM's kernels and kvtier's own engine compute the same
model's KV with different floating-point rounding, and kvtier promises tokens equal to
what the reading engine computes alone, so the two never share a namespace. Pure file
reads; thread-safe.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

DATA_SAMPLE_BYTES = 4096  # of each safetensors file's data section


def _safetensors_digest(path: Path, digest: hashlib.blake2b) -> None:
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        digest.update(f.read(header_len))
        digest.update(f.read(DATA_SAMPLE_BYTES))


def vllm_model_id(model: str, revision: str | None = None) -> str:
    """The identity of the weights vLLM loads from ``model`` (a folder, or a hub name)."""
    folder = Path(model)
    digest = hashlib.blake2b(digest_size=8)
    if not folder.is_dir():
        digest.update(f"{model}@{revision or ''}".encode())
        return f"vllm-{_slug(model)}-{digest.hexdigest()}"
    config = folder / "config.json"
    kind = "model"
    if config.is_file():
        digest.update(config.read_bytes())
        kind = str(json.loads(config.read_text()).get("model_type", kind))
    for weights in sorted(folder.glob("*.safetensors")):
        digest.update(weights.name.encode())
        _safetensors_digest(weights, digest)
    return f"vllm-{_slug(kind)}-{digest.hexdigest()}"


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"
