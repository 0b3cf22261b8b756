"""Seeded random-weight models of many architecture families, built from a config.

For tests and benchmarks: ``model_config(arch, shape)`` gives a transformers config with
the dimensions of a preset (``tiny`` for unit tests, ``smollm2-135m``, ``llama3-8b`` for GPU
benchmarks), and ``random_model`` builds the model from it without touching the global
RNG. Nothing is downloaded. Pure functions; the returned model is the caller's.
"""

from __future__ import annotations

from typing import Any

import torch

ARCHS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": None},
    "gemma": {"hidden_activation": "gelu_pytorch_tanh"},
    "phi3": {},
    "olmo2": {},
    "cohere": {},
    "granite": {},
    "starcoder2": {"sliding_window": None},
    "stablelm": {},
    "glm": {},
    "smollm3": {},
    "helium": {},
    "gpt_neox": {},
    # Gemma 2 as published: scores soft-capped at 50, logits at 30.
    "gemma2": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {},
}
# Configs that derive the head size from hidden_size / heads (no head_dim field), or have
# no separate KV head count.
_NO_HEAD_DIM = ("phi3", "gpt_neox")
_NO_KV_HEADS = ("gpt_neox",)
_EAGER_ONLY = ("gemma2",)  # transformers has no SDPA attention for these

# Model shapes, independent of the architecture. "tiny" is for unit tests (seconds on CPU);
# the others reproduce real models' KV geometry for planning and GPU benchmarks.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 2048,
        # Some configs default to token ids beyond a tiny vocabulary (phi3: pad 32000).
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "smollm2-135m": {
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
    "llama3-8b": {
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
}


def model_config(arch: str = "llama", shape: str = "tiny", **overrides: Any) -> Any:
    """A transformers config for ``arch`` with the dimensions of ``shape``.

    Args:
        arch: one of ``ARCHS`` (``llama``, ``qwen2``, ``qwen3``, ``mistral``, ``gemma``,
            ``phi3``, ``olmo2``, ``gemma3_text``, …).
        shape: one of ``SHAPES`` (``tiny``, ``smollm2-135m``, ``llama3-8b``).
        **overrides: config fields that replace the shape's values.

    Raises:
        ValueError: unknown ``arch`` or ``shape``.
    """
    from transformers import AutoConfig

    if arch not in ARCHS:
        raise ValueError(f"arch: unknown {arch!r}; accepted: {sorted(ARCHS)}")
    if shape not in SHAPES:
        raise ValueError(f"shape: unknown {shape!r}; accepted: {sorted(SHAPES)}")
    fields = {**SHAPES[shape], **ARCHS[arch], **overrides}
    if arch in _NO_HEAD_DIM:
        head_dim = fields.pop("head_dim", None)
        heads, hidden = fields["num_attention_heads"], fields["hidden_size"]
        if head_dim is not None and head_dim * heads != hidden:
            raise ValueError(
                f"head_dim: {arch} needs head_dim * num_attention_heads == hidden_size, got "
                f"{head_dim} * {heads} != {hidden}"
            )
    if arch in _NO_KV_HEADS:
        fields.pop("num_key_value_heads", None)
    return AutoConfig.for_model(arch, **fields)


def random_model(
    arch: str = "llama",
    shape: str = "tiny",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    attn_implementation: str = "sdpa",
    attention_gain: float = 1.0,
    **overrides: Any,
) -> Any:
    """A seeded random-weight causal LM, in eval mode with gradients off.

    The global RNG is left untouched. Weights are allocated directly on ``device`` so that
    ``shape="llama3-8b"`` can be built on a GPU without a CPU copy.

    Args:
        arch: architecture (see ``model_config``).
        shape: dimensions preset (see ``SHAPES``); ``**overrides`` change single fields.
        seed: RNG seed for the initial weights.
        dtype: weight dtype.
        device: where to allocate the weights (default: CPU).
        attn_implementation: transformers attention implementation name ("sdpa" falls
            back to "eager" for architectures without an SDPA attention).
        attention_gain: factor on every query and key projection weight (and bias), so
            the attention scores grow by its square: random weights give scores near 0,
            where a soft-cap changes nothing; a gain of ~30 brings them to the range of
            Gemma 2's cap of 50.
    """
    from transformers import AutoModelForCausalLM

    config = model_config(arch, shape, **overrides)
    if attn_implementation == "sdpa" and arch in _EAGER_ONLY:
        attn_implementation = "eager"
    target = torch.device(device) if device is not None else torch.device("cpu")
    devices = [target] if target.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), target:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation
        )
    model = model.eval().requires_grad_(False)
    if attention_gain != 1.0:
        for module in model.modules():
            for name in ("q_proj", "k_proj"):
                projection = getattr(module, name, None)
                if isinstance(projection, torch.nn.Linear):
                    projection.weight.mul_(attention_gain)
                    if projection.bias is not None:
                        projection.bias.mul_(attention_gain)
    return model
