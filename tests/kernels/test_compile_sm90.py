"""The compiled (non-interpreted) kernels build for an H100 (sm_90), on a machine without a GPU.

Triton's frontend, its MLIR passes and the ptxas it bundles all run on the CPU, so this catches
errors that the interpreter cannot (types, dot shapes, libdevice calls, layouts) wherever CI has
no GPU. Tile sizes come from the same config functions the launchers use.
"""

from __future__ import annotations

import os

import pytest
import torch

from cachedrag.kernels import _dispatch, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton does not import here")

STRIDES = ("stride_qh", "stride_qt", "stride_kh", "stride_kt", "stride_vh", "stride_vt", "stride_oh", "stride_ot")


def compile_sm90(fn, signature: dict, constexprs: dict, divisible: tuple = (), **options):
    """Compile like a launch would (pointers 16-byte aligned, listed ints divisible by 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(_dispatch.MAX_COMBINE, InterpretedFunction):
        pytest.skip("triton was imported under TRITON_INTERPRET=1; its library cannot compile in this process")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("triton's bundled ptxas is missing")
    kernel = _dispatch.jit(fn)
    names = kernel.arg_names
    full = dict(signature) | {name: "constexpr" for name in constexprs}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, ty in signature.items()
             if ty.startswith("*") or n in divisible}
    compiled = triton.compile(ASTSource(kernel, full, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(options, enable_fp_fusion=True))
    assert compiled.asm["cubin"]
    return compiled


@pytest.fixture
def compiled_mode(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_rerotate_compiles(compiled_mode):
    from cachedrag.kernels.rerotate import _rerotate_kernel

    sig = dict(k_ptr="*bf16", out_ptr="*bf16", new_pos_ptr="*i64", old_pos_ptr="*i64", rows_ptr="*i64",
               inv_freq_ptr="*fp32", H="i32", T="i32", HALF="i32",
               stride_kh="i32", stride_kt="i32", stride_oh="i32", stride_ot="i32")
    compiled = compile_sm90(_rerotate_kernel, sig, dict(HAS_OLD=True, HAS_ROWS=True, PRECISE_TRIG=True,
                                                        BLOCK_T=16, BLOCK_HALF=64),
                            divisible=("stride_kh", "stride_kt", "stride_oh", "stride_ot"), num_warps=8)
    ptx = compiled.asm["ptx"]
    assert "sin.approx" not in ptx and "cos.approx" not in ptx  # full-precision trig


@pytest.mark.parametrize("dtype,D,segments", [(torch.bfloat16, 128, 16), (torch.float16, 64, 0),
                                              (torch.float32, 128, 5)])
def test_selective_attention_compiles(compiled_mode, dtype, D, segments):
    from cachedrag.kernels.selective_attention import _attention_config, _attention_kernel

    ty = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    sig = dict(q_ptr=f"*{ty}", k_ptr=f"*{ty}", v_ptr=f"*{ty}", o_ptr=f"*{ty}", qpos_ptr="*i64",
               bounds_ptr="*i64", mass_ptr="*fp32", T_q="i32", kv_len="i32", G="i32", S="i32", qk_scale="fp32",
               **{name: "i32" for name in STRIDES}, stride_mh="i32", stride_mt="i32")
    block_s = max(16, _dispatch.next_power_of_2(segments)) if segments else 0
    cfg = _attention_config(dtype, D, 4 * 1229, block_s, interp=False)
    consts = dict(HEAD_DIM=D, HAS_SEG=segments > 0, DOT_DTYPE=_dispatch.tl_dtype(dtype),
                  DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                  BLOCK_M=cfg.pop("BLOCK_M"), BLOCK_N=cfg.pop("BLOCK_N"), BLOCK_D=D, BLOCK_S=max(16, block_s))
    compiled = compile_sm90(_attention_kernel, sig, consts, divisible=STRIDES, **cfg)
    if dtype != torch.float32:
        assert "wgmma" in compiled.asm["ptx"] or "mma.sync" in compiled.asm["ptx"]  # tensor cores
