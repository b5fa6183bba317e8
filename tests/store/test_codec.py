"""codec: safetensors round trips, and every kind of damage is a typed error, never a wrong entry."""

from __future__ import annotations

import random

import pytest
import torch

from cachedrag.errors import CorruptCacheError
from cachedrag.store.codec import (
    ChecksumError,
    ForeignEntryError,
    FormatError,
    TruncatedEntryError,
    decode,
    decode_extras,
    decode_layer,
    encode,
    read_header,
)
from cachedrag.store.entry import KVEntry
from tests.store.helpers import NS, key_of, make_entry

KEY = key_of("codec")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("extras", [True, False])
def test_round_trip_is_exact(dtype, extras):
    entry = make_entry(1, dtype=dtype, extras=extras)
    out = decode(encode(KEY, entry, NS), KEY, NS)
    assert out.equal(entry)
    assert out.k.dtype == dtype and out.meta == entry.meta


def test_blob_is_plain_safetensors_with_metadata():
    from safetensors import safe_open

    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(encode(KEY, make_entry(2), NS))
        f.flush()
        with safe_open(f.name, framework="pt") as st:
            md = st.metadata()
            assert md["cachedrag.format"] == "1"
            assert md["cachedrag.namespace"] == NS
            assert md["cachedrag.key"] == KEY
            assert len(md["cachedrag.layer_sha256"].split(",")) == 4
            assert set(st.keys()) == {"k", "v", "token_inter"}


def test_every_truncation_is_detected():
    blob = encode(KEY, make_entry(3), NS)
    cuts = sorted({0, 1, 7, 8, 9, len(blob) // 2, len(blob) - 1, *random.Random(0).sample(range(len(blob)), 40)})
    for cut in cuts:
        with pytest.raises(CorruptCacheError):
            decode(blob[:cut], KEY, NS)


def test_truncated_payload_is_a_truncation_error():
    blob = encode(KEY, make_entry(3), NS)
    with pytest.raises(TruncatedEntryError):
        decode(blob[:-5], KEY, NS)


def test_every_bit_flip_is_detected():
    blob = encode(KEY, make_entry(4), NS)
    rng = random.Random(1)
    positions = list(range(0, len(blob), max(1, len(blob) // 300))) + rng.sample(range(len(blob)), 100)
    for pos in positions:
        damaged = bytearray(blob)
        damaged[pos] ^= 1 << rng.randrange(8)
        try:
            out = decode(bytes(damaged), KEY, NS)
        except CorruptCacheError:
            continue
        # a flip in JSON padding/whitespace may leave the content intact; then it must be exact
        assert out.equal(make_entry(4)), f"bit flip at {pos} served a wrong entry"


def test_payload_flip_is_a_checksum_error():
    blob = bytearray(encode(KEY, make_entry(5), NS))
    blob[-3] ^= 0x10
    with pytest.raises(ChecksumError):
        decode(bytes(blob), KEY, NS)


def test_foreign_namespace():
    blob = encode(KEY, make_entry(6, namespace="othermodel"), "othermodel")
    with pytest.raises(ForeignEntryError):
        decode(blob, KEY, NS)


def test_encode_refuses_an_entry_of_another_namespace():
    with pytest.raises(ForeignEntryError):
        encode(KEY, make_entry(6, namespace="othermodel"), NS)


def test_blob_of_another_key_is_rejected():
    blob = encode(key_of("a"), make_entry(7), NS)
    with pytest.raises(FormatError):
        decode(blob, key_of("b"), NS)


def test_not_safetensors():
    with pytest.raises(CorruptCacheError):
        decode(b"\x00" * 64, KEY, NS)
    with pytest.raises(CorruptCacheError):
        decode(b"", KEY, NS)


def test_layers_and_extras_read_alone_are_exact():
    entry = make_entry(8, dtype=torch.bfloat16)
    blob = encode(KEY, entry, NS)
    reads: list[tuple[int, int]] = []

    def read_at(off: int, ln: int) -> bytes:
        reads.append((off, ln))
        return blob[off : off + ln]

    header = read_header(read_at, len(blob), KEY, NS)
    assert header.n_layers == 4 and header.layered == ("k", "v")
    for l in range(4):
        reads.clear()
        out = decode_layer(header, l, read_at)
        assert torch.equal(out["k"], entry.k[l]) and torch.equal(out["v"], entry.v[l])
        assert sum(n for _, n in reads) == 2 * entry.k[l].numel() * 2  # only this layer's bytes
    assert torch.equal(decode_extras(header, read_at)["token_inter"], entry.tensors["token_inter"])


def test_damaged_layer_is_caught_when_read_alone():
    entry = make_entry(9)
    blob = bytearray(encode(KEY, entry, NS))
    header = read_header(lambda o, n: bytes(blob[o : o + n]), len(blob), KEY, NS)
    off, _ = header.layer_range("v", 2)
    blob[off + 1] ^= 0x01
    read_at = lambda o, n: bytes(blob[o : o + n])  # noqa: E731
    assert torch.equal(decode_layer(header, 1, read_at)["k"], entry.k[1])
    with pytest.raises(ChecksumError):
        decode_layer(header, 2, read_at)


@pytest.mark.parametrize(
    "tensors, problem",
    [
        ({"k": torch.zeros(2, 1, 3, 4)}, "needs tensors"),
        ({"k": torch.zeros(2, 1, 3, 4), "v": torch.zeros(2, 1, 3, 5)}, "must both be"),
        ({"k": torch.zeros(2, 1, 3, 4), "v": torch.zeros(2, 1, 3, 4, dtype=torch.float16)}, "dtype"),
        ({"k": torch.zeros(2, 1, 3), "v": torch.zeros(2, 1, 3)}, "must both be"),
        ({"k": torch.zeros(2, 1, 3, 4), "v": torch.zeros(2, 1, 3, 4), "x": torch.zeros(3, dtype=torch.int64)}, "float32"),
    ],
)
def test_entry_contract(tensors, problem):
    with pytest.raises(ValueError, match=problem):
        KVEntry(tensors, {})


def test_entry_facts():
    e = make_entry(10, layers=3, heads=2, tokens=5, dim=4, dtype=torch.float16)
    assert (e.n_layers, e.n_tokens) == (3, 5)
    assert e.nbytes == 2 * 3 * 2 * 5 * 4 * 2 + 5 * 4
    assert e.layered_names() == ("k", "v") and e.extra_names() == ("token_inter",)
    k1, v1 = e.layer(1)
    assert k1.shape == (2, 5, 4) and torch.equal(v1, e.v[1])
    assert e.clone().equal(e) and e.to("cpu").equal(e)


def test_k_and_v_of_different_shapes_are_refused_even_with_valid_checksums(monkeypatch):
    from cachedrag.store.codec import FormatError, decode
    from cachedrag.store.entry import KVEntry

    entry = make_entry(1)
    entry.tensors["v"] = entry.v[:, :1].clone()  # [L, 1, T, D]: crafted after validation
    monkeypatch.setattr(KVEntry, "validate", lambda self: None)  # a writer that skips the checks
    blob = encode(key_of(1), entry, NS)  # checksums computed over the crafted tensors
    monkeypatch.undo()
    with pytest.raises(FormatError, match="differ"):
        decode(blob, key_of(1), NS)
