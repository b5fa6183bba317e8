"""Group-wise int4 weights: quantising, the two layouts the codes are kept in, and the dequantised weight.

Owns: the int4 weight format's arithmetic (``quantize``: per group of ``INT4_GROUP`` input columns,
asymmetric, ``w = (q - 8) * scale + zero`` with ``q`` in 0..15 and scale/zero rounded to bf16 first,
``q`` chosen against the rounded values) and ``Int4Weight``, one weight kept ONCE in one of two layouts
(``storage``):

- ``"tiles"`` (where the native library reads int4: AVX512-BF16): the fused decode step's tiles of 16
  rows (``to_tiles``, ``csrc/int4_decode.cpp``), scales and zeros inside. The fused step reads them as
  they are; few-row matmuls run the native ``int4_linear`` (the fused step's projection); a prefill's
  matmul dequantises the weight natively (``int4_dequantize``) into one transient bf16 copy.
- ``"torch"`` (elsewhere: the reference): torch's CPU int4 kernel layout
  (``_convert_weight_to_int4pack_for_cpu``, which ``_weight_int4pack_mm_for_cpu`` reads) plus
  ``scale_zero``; few rows through that kernel, many through the weight dequantised in torch,
  ``ROW_BLOCK`` rows at a time.

Contract: ``dequantized()`` equals ``reference_dequantized(codes, scale_zero)`` bit for bit in both
storages (tests); ``matmul``'s kernels (both storages) compute with the unrounded ``(q - 8) * scale +
zero`` in float32, so they differ from ``x @ dequantized()^T`` by its bf16 rounding of the weight.
torch's packed layout is private: :func:`layout` finds it once per process by packing probe codes (full
row blocks and tails) and checking the inverse below on them; where no known layout inverts them
(another torch or CPU), the codes are kept a second time in a plain layout (``[O', I/2]`` bytes, column
pairs) and read from there, 0.5 bytes a weight more, never a wrong value.

Does not own: when a projection calls the kernel or the dequantised matmul (``weights.py``), the native
code (``model/native.py``).
"""

from __future__ import annotations

import threading
from functools import lru_cache
from typing import Literal

import torch
import torch.nn.functional as F

INT4_GROUP = 32  # input columns per scale/zero group (= llama.cpp's Q4_1 block)
ROW_MULTIPLE = 16  # the CPU kernel wants a multiple of 16 output rows (padded with zero rows)
ROW_BLOCK = 512  # rows (de)quantised per step: the float32 intermediate stays in cache
PACK_ROWS = 4096  # rows packed per call of torch's packing op (a multiple of its row blocks)
_BLOCKS = (64, 32)  # row-block sizes torch packs with (AVX-512: 64; AVX2 and others: 32)
TILE_ROWS, TILE_BYTES = 16, 320  # the native tiles: 16 rows x one group of 32 columns, scales and zeros inside
#: None: "tiles" where the native library reads int4, else "torch"; tests set it to build either storage
STORAGE: Literal["tiles", "torch"] | None = None


def quantize(weight: torch.Tensor | list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [O', I] uint8 in 0..15, scale_zero [G, O', 2] bf16)`` of ``weight`` ``[O, I]`` (or its row
    blocks in order, quantised as if concatenated), ``O'`` the rows padded to ``ROW_MULTIPLE`` (zero
    rows), ``G = I / INT4_GROUP``. ``ROW_BLOCK`` rows at a time: float32 temporaries of one block only."""
    parts = list(weight) if isinstance(weight, (list, tuple)) else [weight]
    out_f, in_f = sum(p.shape[0] for p in parts), parts[0].shape[1]
    if in_f % INT4_GROUP:
        raise ValueError(f"int4 weights need input sizes divisible by {INT4_GROUP}, got a [{out_f}, {in_f}] weight")
    pad = -out_f % ROW_MULTIPLE
    if pad:
        parts.append(torch.zeros(pad, in_f))
    codes = torch.empty(out_f + pad, in_f, dtype=torch.uint8)  # [O', I]
    scale_zero = torch.empty(out_f + pad, in_f // INT4_GROUP, 2, dtype=torch.bfloat16)  # [O', G, 2]
    row = 0
    for part in parts:
        for start in range(0, part.shape[0], ROW_BLOCK):
            w = part[start:start + ROW_BLOCK].float()  # [b, I]
            b = w.shape[0]
            w = w.view(b, in_f // INT4_GROUP, INT4_GROUP)  # [b, G, g]
            lo, hi = w.amin(-1), w.amax(-1)  # [b, G]
            scale = ((hi - lo) / 15).clamp_min(1e-12).to(torch.bfloat16).float()  # [b, G]
            zero = (lo + 8 * scale).to(torch.bfloat16).float()  # [b, G]
            q = torch.round((w - zero[..., None]) / scale[..., None] + 8).clamp(0, 15)  # [b, G, g]
            codes[row:row + b] = q.view(b, in_f).to(torch.uint8)
            scale_zero[row:row + b] = torch.stack([scale, zero], -1).to(torch.bfloat16)
            row += b
    return codes, scale_zero.transpose(0, 1).contiguous()  # [O', I], [G, O', 2]


def torch_pack(codes: torch.Tensor) -> torch.Tensor:
    """torch's CPU kernel layout of ``codes`` ``[O', I]`` (uint8 ``[O', I/2]``, private). Where the layout is
    known (its row blocks independent), ``PACK_ROWS`` rows at a time: the op's int32 input is never the
    whole weight (4 bytes a code)."""
    block, rows = layout(), codes.shape[0]
    if block is None or rows <= PACK_ROWS:
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    out = torch.empty(rows, codes.shape[1] // 2, dtype=torch.uint8)  # [O', I/2]
    flat, half = out.view(-1), codes.shape[1] // 2
    for start in range(0, rows, PACK_ROWS):
        stop = min(start + PACK_ROWS, rows)
        flat[start * half:stop * half] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes[start:stop].to(torch.int32), 1).view(-1)
    return out


def plain_pack(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` ``[O', I]`` two to a byte: column ``2j`` in the low nibble of byte ``j``, ``2j + 1`` high."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)  # [O', I/2]


def _unpack_plain(packed: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    rows = packed[start:stop]  # [b, I/2]
    return torch.stack([rows & 15, rows >> 4], -1).view(stop - start, -1)  # [b, I]


def _unpack_torch(packed: torch.Tensor, block: int, start: int, stop: int, n_rows: int, cols: int) -> torch.Tensor:
    """Rows ``start:stop`` (``start`` a multiple of ``block``) of codes packed by torch with row blocks of
    ``block``: a full block is ``[I, block/2]`` bytes, byte ``j`` of column ``k`` holding row ``j`` (low
    nibble) and row ``j + block/2`` (high); the tail block (fewer rows) holds rows ``2j`` and ``2j + 1``."""
    flat = packed.view(-1)
    end = min(n_rows, -(-stop // block) * block)  # whole blocks covering the rows asked for
    full_stop = min(end, n_rows // block * block)
    parts = []
    if full_stop > start:
        nb = (full_stop - start) // block
        p = flat[start * cols // 2:full_stop * cols // 2].view(nb, cols, block // 2)  # [nb, I, B/2]
        parts.append(torch.cat([p & 15, p >> 4], -1).transpose(1, 2).reshape(nb * block, cols))  # [nb*B, I]
    if end > full_stop:
        tail = n_rows - full_stop
        p = flat[full_stop * cols // 2:n_rows * cols // 2].view(cols, tail // 2)  # [I, t/2]
        parts.append(torch.stack([p & 15, p >> 4], -1).view(cols, tail).t())  # [t, I]
    codes = parts[0] if len(parts) == 1 else torch.cat(parts)  # [end - start, I]
    return codes[:stop - start]


@lru_cache(maxsize=1)
def layout() -> int | None:
    """The row-block size of torch's int4 packing on this machine (checked by inverting probe codes with
    full blocks and every tail size), or None when neither known layout inverts them."""
    g = torch.Generator().manual_seed(0)
    for block in _BLOCKS:
        ok = True
        for rows in (16, 32, 48, block, block + 16, 2 * block + 48):
            codes = torch.randint(0, 16, (rows, 96), dtype=torch.uint8, generator=g)  # [O', I]
            try:
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
                got = _unpack_torch(packed, block, 0, rows, rows, 96)
            except RuntimeError:  # a view that does not fit this layout's sizes
                ok = False
                break
            if not torch.equal(got, codes):
                ok = False
                break
        if ok:
            return block
    return None


def reference_dequantized(codes: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """``(q - 8) * scale + zero`` rounded to bf16 from the codes ``[O', I]`` and ``scale_zero`` ``[G, O', 2]``:
    ``[O', I]`` (the reference of ``Int4Weight.dequantized``)."""
    rows, cols = codes.shape
    sz = scale_zero.float().transpose(0, 1)  # [O', G, 2]
    w = (codes.float().view(rows, -1, INT4_GROUP) - 8) * sz[..., :1] + sz[..., 1:]  # [O', G, g]
    return w.view(rows, cols).to(torch.bfloat16)


_scratch = threading.local()


def scratch(rows: int, cols: int) -> torch.Tensor:
    """This thread's transient bf16 weight buffer as ``[rows, cols]``: one per thread, grown to the largest
    weight dequantised in it and reused, so a prefill does not fault fresh pages in for every weight (a
    fresh 55 MB tensor per 1.5B gate/up call cost more than its dequantisation). The view is valid until
    this thread's next call; only for a matmul's operand (never returned to a caller)."""
    need = rows * cols
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < need:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            _scratch.buf = buf = torch.empty(need, dtype=torch.bfloat16)
    return buf[:need].view(rows, cols)


def native_int4():
    """The native library's module where it reads int4 tiles (AVX512-BF16), else None."""
    from cachedrag.model import native

    module = native.kernel()
    return module if module is not None and module.int4_available() else None


def to_tiles(codes: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """The codes ``[O', I]`` and ``scale_zero`` ``[G, O', 2]`` as tiles ``[O'/16, G, 320]`` uint8: per tile of 16
    rows and group of 32 columns, 4 blocks of 32 16-bit words (word ``2i + e``, nibble ``j`` = row ``i``,
    column ``8c + 2j + e``), then the rows' bf16 scales and zeros (``csrc/int4_decode.cpp``)."""
    rows, cols = codes.shape
    tiles, groups = rows // TILE_ROWS, cols // INT4_GROUP
    q = codes.view(tiles, TILE_ROWS, groups, 4, 4, 2).permute(0, 2, 3, 1, 5, 4)  # [T, G, c, i, e, j]
    words = torch.stack([q[..., 0] | (q[..., 1] << 4), q[..., 2] | (q[..., 3] << 4)], -1)  # [T, G, c, i, e, 2] bytes
    sz = scale_zero.view(groups, tiles, TILE_ROWS, 2).permute(1, 0, 3, 2)  # [T, G, 2, 16] bf16
    sz = sz.contiguous().view(torch.uint8).reshape(tiles, groups, 64)  # [T, G, 64]: 16 scales, 16 zeros
    return torch.cat([words.reshape(tiles, groups, 256), sz], -1).contiguous()  # [T, G, 320]


def from_tiles(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``to_tiles``' inverse: ``(codes [O', I] uint8, scale_zero [G, O', 2] bf16)``."""
    t, groups = tiles.shape[:2]
    b = tiles[..., :256].reshape(t, groups, 4, TILE_ROWS, 2, 2)  # [T, G, c, i, e, byte]
    q = torch.stack([b[..., 0] & 15, b[..., 0] >> 4, b[..., 1] & 15, b[..., 1] >> 4], -1)  # [T, G, c, i, e, j]
    codes = q.permute(0, 3, 1, 2, 5, 4).reshape(t * TILE_ROWS, groups * INT4_GROUP)  # [O', I]
    sz = tiles[..., 256:].contiguous().view(torch.bfloat16).view(t, groups, 2, TILE_ROWS)  # [T, G, 2, 16]
    return codes.contiguous(), sz.permute(1, 0, 3, 2).reshape(groups, t * TILE_ROWS, 2).contiguous()


class Int4Weight:
    """One weight ``[O, I]`` in int4, kept once (``storage``, module docstring): ``tiles`` ``[O'/16, G, 320]``,
    or torch's packed codes (``packed``), ``scale_zero`` ``[G, O', 2]`` bf16 and the plain-layout codes
    only where torch's layout is unknown."""

    def __init__(self, weight: torch.Tensor | list[torch.Tensor], storage: Literal["tiles", "torch"] | None = None):
        """``weight``: ``[O, I]`` or its row blocks in order (``quantize``); ``storage``: None =
        ``STORAGE``, else "tiles" where the native library reads them."""
        parts = list(weight) if isinstance(weight, (list, tuple)) else [weight]
        self.out_features, self.in_features = sum(p.shape[0] for p in parts), parts[0].shape[1]
        codes, scale_zero = quantize(parts)  # [O', I], [G, O', 2]
        self.rows = codes.shape[0]
        self.storage = storage or STORAGE or ("tiles" if native_int4() is not None else "torch")
        self.tiles = self.packed = self.scale_zero = self.plain = None
        if self.storage == "tiles":
            self.tiles = to_tiles(codes, scale_zero)  # [O'/16, G, 320] uint8
            return
        self.scale_zero = scale_zero
        self.packed = torch_pack(codes)  # [O', I/2] uint8
        self.block = layout()
        self.plain = plain_pack(codes) if self.block is None else None  # [O', I/2] uint8 or None

    @property
    def nbytes(self) -> int:
        """Bytes a kernel call reads (the codes and the scales and zeros)."""
        if self.tiles is not None:
            return self.tiles.numel()
        return self.packed.numel() + self.scale_zero.numel() * self.scale_zero.element_size()

    def resident_bytes(self) -> int:
        """Bytes this weight keeps in memory."""
        return self.nbytes + (self.plain.numel() if self.plain is not None else 0)

    def state(self) -> tuple[torch.Tensor, ...]:
        """The tensors this weight keeps (what two equal quantisations hold alike)."""
        return (self.tiles,) if self.tiles is not None else (self.packed, self.scale_zero)

    def codes_and_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes [O', I] uint8, scale_zero [G, O', 2] bf16)`` read back from either storage (a copy)."""
        if self.tiles is not None:
            return from_tiles(self.tiles)
        return self.codes(0, self.rows), self.scale_zero

    def as_tiles(self) -> torch.Tensor:
        """The tiles ``[O'/16, G, 320]``: the kept ones, or (torch storage) a new copy."""
        return self.tiles if self.tiles is not None else to_tiles(*self.codes_and_scales())

    def torch_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed, scale_zero)`` as torch's int4 kernel reads them: the kept ones, or (tiles) a new copy."""
        if self.tiles is None:
            return self.packed, self.scale_zero
        codes, scale_zero = from_tiles(self.tiles)
        return torch_pack(codes), scale_zero

    def codes(self, start: int, stop: int) -> torch.Tensor:
        """Torch storage: the codes of padded rows ``start:stop`` (``start`` a multiple of ``ROW_BLOCK``):
        ``[b, I]`` uint8."""
        if self.plain is not None:
            return _unpack_plain(self.plain, start, stop)
        return _unpack_torch(self.packed, self.block, start, stop, self.rows, self.in_features)

    def dequantized(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The weight the kernels compute with, ``[O, I]`` bf16 (into ``out`` when given, else a new tensor):
        natively from the tiles, or ``ROW_BLOCK`` rows at a time from torch's layout."""
        out_f, cols = self.out_features, self.in_features
        if self.tiles is not None:
            return native_int4().int4_dequantize(self.tiles, out_f, out)
        if out is None:
            out = torch.empty(out_f, cols, dtype=torch.bfloat16)  # [O, I]
        for start in range(0, out_f, ROW_BLOCK):
            stop = min(start + ROW_BLOCK, out_f)
            sz = self.scale_zero[:, start:stop].float().transpose(0, 1).unsqueeze(-1)  # [b, G, 2, 1]
            w = self.codes(start, stop).view(stop - start, -1, INT4_GROUP).float().sub_(8)  # [b, G, g]
            out[start:stop] = w.mul_(sz[:, :, 0]).add_(sz[:, :, 1]).view(stop - start, cols)
        return out

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T (+ bias)`` for few rows: ``[N, I] -> [N, O]`` bf16, through the native tiles' kernel or
        torch's int4 kernel."""
        if self.tiles is not None:
            empty = torch.empty(0)
            return native_int4().int4_linear(x.contiguous(), self.tiles, self.out_features,
                                             bias if bias is not None else empty)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP,
                                                         self.scale_zero)[:, :self.out_features]  # [N, O]
        return out + bias if bias is not None else out
