"""int8 weight-only levels stored as the fused decode step's tiles (``csrc/int8_tiles.cpp``,
``weights.PackedLinear``) against the row-major levels and torch (the reference)."""

import pytest
import torch
import torch.nn.functional as F

from cachedrag.model import weights as weights_module
from cachedrag.model.weights import Numerics, PackedLinear, int8_rows, int8_tiles

native = int8_tiles()
needs_tiles = pytest.mark.skipif(native is None, reason="int8 tiles need the native library on an AVX-512 CPU")
pytestmark = needs_tiles


def _levels(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.1  # [O, I]
    q, scale = int8_rows(w)  # [O, I] int8, [O] float32
    return q, scale


@pytest.mark.parametrize("rows,cols", [(1, 16), (31, 48), (33, 40), (70, 17), (100, 96), (257, 1536)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_is_the_torch_expression_bit_for_bit(rows, cols, dtype):
    """``int8_tiles_dequantize`` equals ``q.to(dtype) * scale[:, None]`` bit for bit (row counts no
    multiple of 32 or 4, column counts no multiple of 16), and the tiles hold the levels."""
    q, scale = _levels(rows, cols, rows)
    scale = scale.to(dtype)
    tiles = native.int8_tiles_pack(q)  # [T, I, 32]
    assert tiles.shape == ((rows + 31) // 32, cols, 32)
    assert torch.equal(tiles.permute(0, 2, 1).reshape(-1, cols)[:rows], q)
    assert not tiles.permute(0, 2, 1).reshape(-1, cols)[rows:].any()  # the last tile's padding rows are zero
    got = native.int8_tiles_dequantize(tiles, scale, rows)  # [O, I]
    assert got.dtype == dtype and torch.equal(got, q.to(dtype) * scale[:, None])
    buf = torch.full((rows, cols), float("nan"), dtype=dtype)  # a reused buffer: every value overwritten
    assert native.int8_tiles_dequantize(tiles, scale, rows, buf).data_ptr() == buf.data_ptr() and torch.equal(buf, got)


@pytest.mark.parametrize("ff,cols", [(1, 16), (16, 48), (21, 40), (35, 17), (200, 96)])
def test_gate_up_tiles_hold_16_units_of_each_half(ff, cols):
    """A gate/up weight's tiles ``[T, I, 2, 16]``: tile t holds gate units 16t.. then the same up units
    (missing units zero); dequantised in the weight's own row order, bit for bit the torch expression."""
    q, scale = _levels(2 * ff, cols, ff)
    scale = scale.bfloat16()
    tiles = native.int8_tiles_pack(q, True)  # [T, I, 2, 16]
    units = (ff + 15) // 16
    assert tiles.shape == (units, cols, 2, 16)
    halves = tiles.permute(2, 0, 3, 1).reshape(2, units * 16, cols)  # [2, 16 T, I]
    assert torch.equal(halves[0, :ff], q[:ff]) and torch.equal(halves[1, :ff], q[ff:]) and not halves[:, ff:].any()
    assert torch.equal(native.int8_tiles_dequantize(tiles, scale, 2 * ff), q.bfloat16() * scale[:, None])


def test_dequantize_keeps_nan_and_rounds_ties_to_even():
    """Scales that make products fall on bf16 ties, and a NaN scale: torch's rounding, bit for bit."""
    q = torch.tensor([[1, 3, -5, 127, -127, 0, 2, 7] * 4] * 3, dtype=torch.int8)  # [3, 32]
    scale = torch.tensor([1.0 + 2 ** -7, float("nan"), 3.0 * (1 + 2 ** -7)]).bfloat16()  # [3]
    tiles = native.int8_tiles_pack(q)
    got, want = native.int8_tiles_dequantize(tiles, scale, 3), q.bfloat16() * scale[:, None]
    assert torch.equal(got[[0, 2]], want[[0, 2]]) and got[1].isnan().all() and want[1].isnan().all()


@pytest.mark.parametrize("n", [1, 3, 16])
@pytest.mark.parametrize("bias,gate_up", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("rows,cols", [(34, 48), (70, 40), (96, 17)])
def test_linear_is_f_linear_on_the_dequantised_weight(n, bias, gate_up, rows, cols):
    """``int8_tiles_linear``: ``(x @ q^T) * scale + bias`` in float32 (the scale applied to the sums, as
    ``_weight_int8pack_mm`` does), rounded once to bf16: within that rounding (and float32 sums) of
    float32 ``F.linear`` on the unrounded weight ``q * scale``, and within it plus each weight's bf16
    rounding of ``F.linear`` on the dequantised (bf16) weight. Gate/up tiles: the rows in the weight's order."""
    q, scale = _levels(rows, cols, cols)
    scale = scale.bfloat16()
    b = torch.randn(rows, generator=torch.Generator().manual_seed(1)).bfloat16() if bias else torch.empty(0)
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n)).bfloat16()  # [N, I]
    got = native.int8_tiles_linear(x, native.int8_tiles_pack(q, gate_up), scale, b, rows).float()  # [N, O]
    assert got.shape == (n, rows)
    exact = q.float() * scale.float()[:, None]  # [O, I]
    mass = F.linear(x.float().abs(), exact.abs())  # [N, O]
    want = F.linear(x.float(), exact, b.float() if bias else None)  # [N, O]
    assert ((got - want).abs() <= want.abs() * 2 ** -8 + mass * 1e-6).all()
    deq = F.linear(x.float(), (q.bfloat16() * scale[:, None]).float(), b.float() if bias else None)  # [N, O]
    assert ((got - deq).abs() <= deq.abs() * 2 ** -8 + mass * 2 ** -8).all()
    assert native.int8_tiles_linear(x, native.int8_tiles_pack(q, gate_up), scale, b, rows).dtype == torch.bfloat16


def _pair(w, b, monkeypatch, gate_up=False):
    tiles = PackedLinear(w, b, Numerics(weights="int8"), gate_up=gate_up)
    monkeypatch.setattr(weights_module, "INT8_TILES", False)
    rows = PackedLinear(w, b, Numerics(weights="int8"), gate_up=gate_up)
    monkeypatch.setattr(weights_module, "INT8_TILES", True)
    return tiles, rows


@pytest.mark.parametrize("bias,gate_up", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("out_features,in_features", [(48, 32), (70, 40)])
def test_packed_linear_of_tiles_agrees_with_the_row_major_reference(bias, gate_up, out_features, in_features,
                                                                    monkeypatch):
    """A ``PackedLinear`` that stores only tiles holds the reference's levels (``qweight``, ``levels``),
    its weight bit for bit, prefill rows (dequantised matmul) bit for bit, and few rows within a bf16
    rounding of the reference's kernel; one copy of the levels (plus the last tile's zero rows).
    gate/up without bias: tiles of 16 units' gate and up rows; with a bias, plain tiles."""
    torch.manual_seed(0)
    w = torch.randn(out_features, in_features) * 0.1  # [O, I]
    b = torch.randn(out_features) if bias else None
    tiles, rows = _pair(w, b, monkeypatch, gate_up)
    assert tiles.tiles is not None and tiles.qrows is None and rows.tiles is None and rows.qrows is not None
    assert tiles.tiles.dim() == (4 if gate_up and not bias else 3)
    assert torch.equal(tiles.qweight, rows.qweight) and torch.equal(tiles.dequantized(), rows.dequantized())
    ids = torch.tensor([0, out_features - 1, 33, 5])
    assert torch.equal(tiles.levels(ids), rows.qrows[ids])
    assert tiles.nbytes == rows.nbytes
    padding = tiles.tiles.numel() - out_features * in_features  # the last tile's zero rows
    assert 0 <= padding < 32 * in_features and tiles.resident_bytes == rows.resident_bytes + padding
    x = torch.randn(40, in_features).bfloat16()  # [T, I]
    assert torch.equal(tiles(x), rows(x)) and torch.equal(tiles(x), rows(x))  # the reused buffer again
    deq = tiles.dequantized().float()
    for n in (1, 3, 16):
        want = F.linear(x[:n].float(), deq, b.bfloat16().float() if bias else None)  # [N, O]
        got = tiles(x[:n].view(1, n, in_features))  # [1, N, O]
        assert got.shape == (1, n, out_features) and got.dtype == torch.bfloat16
        mass = F.linear(x[:n].float().abs(), deq.abs())  # [N, O]: each weight's bf16 rounding, as above
        assert ((got[0].float() - want).abs() <= want.abs() * 2 ** -8 + mass * 2 ** -8).all()
        assert (got[0].float() - rows(x[:n]).float()).abs().max() <= 0.02 * want.abs().max()


def test_int8_dynamic_keeps_row_major_levels(monkeypatch):
    """int8-dynamic reads its levels through fbgemm's prepack: row-major, never tiles."""
    from cachedrag.model.weights import vnni_available

    if not vnni_available() or torch.backends.quantized.engine not in ("x86", "fbgemm"):
        pytest.skip("int8-dynamic needs fbgemm with VNNI")
    w = torch.randn(48, 32, generator=torch.Generator().manual_seed(2)) * 0.1
    dyn = PackedLinear(w, None, Numerics(weights="int8-dynamic"))
    assert dyn.tiles is None and dyn.qrows is not None and dyn.dynamic is not None
