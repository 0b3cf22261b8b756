from __future__ import annotations

import pytest
import torch

from kvtier.kv import KeyHasher, KVLayout, Namespace


def test_chain_covers_only_full_chunks(layout: KVLayout) -> None:
    hasher = KeyHasher(Namespace("m", layout))
    assert len(hasher.chain(list(range(47)))) == 2
    assert len(hasher.chain(list(range(48)))) == 3
    assert hasher.chain([]) == []


def test_keys_are_chained_on_the_prefix(layout: KVLayout) -> None:
    hasher = KeyHasher(Namespace("m", layout))
    a = hasher.chain(list(range(32)))
    b = hasher.chain([*range(16), *range(100, 116)])
    assert a[0] == b[0] and a[1] != b[1]
    # Same second-chunk tokens after a different first chunk give a different key.
    c = hasher.chain([*range(1, 17), *range(16, 32)])
    assert c[1] != a[1]


@pytest.mark.parametrize(
    "other",
    [
        Namespace("other-model", KVLayout(2, 2, 8, chunk_tokens=16)),
        Namespace("m", KVLayout(2, 2, 8, torch.float16, chunk_tokens=16)),
        Namespace("m", KVLayout(2, 2, 8, chunk_tokens=16), tenant_salt="tenant-b"),
        Namespace("m", KVLayout(3, 2, 8, chunk_tokens=16)),
    ],
)
def test_namespace_separates_models_formats_and_tenants(layout: KVLayout, other: Namespace) -> None:
    ids = list(range(16))
    assert KeyHasher(Namespace("m", layout)).chain(ids) != KeyHasher(other).chain(ids)


def test_bad_digest_size_names_the_field(layout: KVLayout) -> None:
    with pytest.raises(ValueError, match="digest_bytes"):
        KeyHasher(Namespace("m", layout), digest_bytes=0)


def test_layout_sizes_of_the_embedded_model() -> None:
    smollm = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, chunk_tokens=256)
    assert smollm.token_nbytes == 46_080  # 46 KB a token, as DESIGN says
    assert smollm.chunk_nbytes == 256 * 46_080
    assert smollm.layer_nbytes * 30 == smollm.chunk_nbytes


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "chunk_tokens"])
def test_layout_rejects_non_positive_sizes(field: str) -> None:
    kwargs = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "chunk_tokens": 16, field: 0}
    with pytest.raises(ValueError, match=field):
        KVLayout(**kwargs)
