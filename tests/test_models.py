from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

from kvtier.models import (
    ARCHS,
    LoadedModel,
    ModelLoadError,
    cache_root,
    converted_folder,
    embedded_gguf_path,
    load_model,
    model_config,
    random_model,
)


def tiny_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(40)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_random_model_runs(arch: str) -> None:
    model = random_model(arch)
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    ids = torch.randint(3, 256, (2, 6))
    logits = model(ids).logits
    assert logits.shape == (2, 6, 256)
    assert torch.isfinite(logits).all()


def test_random_model_is_seeded_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first = random_model(seed=7)
    assert torch.equal(torch.rand(1), before)
    second = random_model(seed=7)
    other = random_model(seed=8)
    weights = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(first.state_dict()[weights], second.state_dict()[weights])
    assert not torch.equal(first.state_dict()[weights], other.state_dict()[weights])


def test_random_model_overrides() -> None:
    model = random_model("qwen2", num_hidden_layers=3, num_key_value_heads=1, dtype=torch.bfloat16)
    assert len(model.model.layers) == 3
    assert model.config.num_key_value_heads == 1
    assert model.dtype == torch.bfloat16
    assert model.config._attn_implementation == "sdpa"
    eager = random_model(attn_implementation="eager")
    assert eager.config._attn_implementation == "eager"


def test_llama3_8b_shape() -> None:
    config = model_config("llama", "llama3-8b")
    assert (config.num_hidden_layers, config.num_attention_heads) == (32, 32)
    assert (config.num_key_value_heads, config.head_dim, config.hidden_size) == (8, 128, 4096)
    # The meta device builds the full model without allocating weights.
    model = random_model("llama", "llama3-8b", device="meta", dtype=torch.bfloat16)
    assert 7.9e9 < sum(p.numel() for p in model.parameters()) < 8.1e9


def test_model_config_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="arch"):
        model_config("gpt9")
    with pytest.raises(ValueError, match="shape"):
        model_config("llama", "huge")
    with pytest.raises(ValueError, match="head_dim"):
        model_config("phi3", head_dim=32)


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="does not exist") as info:
        load_model(missing)
    assert str(missing) in str(info.value)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(tmp_path)


def test_load_local_folder(tmp_path: Path) -> None:
    model = random_model("llama", tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "tiny")
    tiny_tokenizer().save_pretrained(tmp_path / "tiny")
    loaded = load_model(tmp_path / "tiny", attn_implementation="eager", device="cpu")
    assert isinstance(loaded, LoadedModel)
    assert loaded.source == str((tmp_path / "tiny").resolve())
    assert loaded.model_id.startswith("tiny-")
    assert loaded.model_id == load_model(tmp_path / "tiny").model_id
    assert not loaded.model.training
    ids = torch.tensor([loaded.tokenizer("w1 w2 w3")["input_ids"]])
    torch.testing.assert_close(loaded.model(ids).logits, model(ids).logits)


def test_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("KVTIER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "kvtier"


def test_embedded_gguf_is_found() -> None:
    gguf = embedded_gguf_path()
    assert gguf.is_file() and gguf.suffix == ".gguf"
    folder = converted_folder(gguf, "/cache")
    assert folder.parent == Path("/cache/models")
    assert folder.name.startswith("smollm2-135m-instruct-")
    assert folder == converted_folder(gguf, "/cache")  # the digest is stable


class FakeGGUF:
    """Stands in for transformers' GGUF loading: a tiny tied model and tokenizer, instantly."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_tokenizer: bool = False) -> None:
        self.model_loads = 0
        self.reference = random_model("llama", seed=3, tie_word_embeddings=True)
        real_model = transformers.AutoModelForCausalLM.from_pretrained
        real_tokenizer = transformers.AutoTokenizer.from_pretrained

        def fake_model(*args: Any, **kwargs: Any) -> Any:
            if "gguf_file" not in kwargs:
                return real_model(*args, **kwargs)
            self.model_loads += 1
            model = random_model("llama", seed=3, tie_word_embeddings=True)
            model.config.quantization_config = {"quant_method": "gguf"}
            return model

        def fake_tokenizer(*args: Any, **kwargs: Any) -> Any:
            if "gguf_file" not in kwargs:
                return real_tokenizer(*args, **kwargs)
            if fail_tokenizer:
                raise OSError("disk full")
            return tiny_tokenizer()

        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_model)
        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake_tokenizer)


@pytest.fixture
def gguf_file(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "Tiny-Model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 16)
    yield path


def test_gguf_is_converted_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, gguf_file: Path
) -> None:
    fake = FakeGGUF(monkeypatch)
    cache = tmp_path / "cache"
    first = load_model(gguf_file, cache_dir=cache, attn_implementation="eager")
    folder = Path(first.source)
    assert folder.parent == cache / "models" and folder.name.startswith("tiny-model-")
    assert first.model_id == folder.name
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "lm_head.weight" not in load_file(str(folder / "model.safetensors"))
    ids = torch.tensor([[1, 5, 9, 4]])
    torch.testing.assert_close(first.model(ids).logits, fake.reference(ids).logits)
    assert torch.equal(first.model.lm_head.weight, first.model.model.embed_tokens.weight)

    second = load_model(gguf_file, cache_dir=cache)
    assert fake.model_loads == 1
    assert second.source == first.source
    assert not list((cache / "models").glob(".tmp-*"))


def test_failed_conversion_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, gguf_file: Path
) -> None:
    FakeGGUF(monkeypatch, fail_tokenizer=True)
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match="KVTIER_CACHE_DIR"):
        load_model(gguf_file, cache_dir=cache)
    assert list((cache / "models").iterdir()) == []


@pytest.fixture(scope="module")
def embedded() -> LoadedModel:
    return load_model()  # converts into the user cache the first time (~20-30 s)


def greedy(loaded: LoadedModel, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    new = loaded.model.generate(
        input_ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2
    )
    return new[0, input_ids.shape[1] :]


@pytest.mark.slow
def test_embedded_model_answers_paris(embedded: LoadedModel) -> None:
    tokenizer = embedded.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    ids = prompt["input_ids"]
    answer = tokenizer.decode(greedy(embedded, ids, 12), skip_special_tokens=True)
    assert "Paris" in answer
    assert embedded.model_id.startswith("smollm2-135m-instruct-")
    assert embedded.model.config.num_key_value_heads == 3


@pytest.mark.slow
def test_converted_folder_matches_gguf(embedded: LoadedModel) -> None:
    gguf = embedded_gguf_path()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    ).eval()
    ids = embedded.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(embedded.model(ids).logits, reference(ids).logits)
    ours = greedy(embedded, ids, 8)
    assert torch.equal(ours, greedy(LoadedModel(reference, None, "gguf", str(gguf)), ids, 8))
    assert "Paris" in embedded.tokenizer.decode(ours)
