"""Ahead-of-time compiled static-shape parts of the one-token decode step (``compile=True``).

Owns: ``CompiledDecode``: the parts of a decode layer whose shapes never change (one row),
compiled by AOTInductor (``torch.export`` + ``torch._inductor.aoti_compile_and_package``) into
three packages shared by every layer (the layer's weights are arguments, not constants):

- ``first``: RMSNorm + fused qkv projection + RoPE of layer 0;
- ``mid``: layer ``i``'s o-projection + residual + RMSNorm + gate/up + SiLU x up + down + residual,
  then layer ``i+1``'s RMSNorm + qkv + RoPE (one call per layer boundary);
- ``last``: the last layer's post-attention part and the final RMSNorm.

Attention (its key count grows every step) stays eager between the calls (the runner's
``_attend_row``: the split-K kernel by default), as do the K/V row writes and the LM head (attention and the writes inside the package, the KV length a dynamic
dimension, saved <= ~1 ms per token: the flash kernel's own time dominates; docs/notes/speed.md
"Decode, round 6"). Packages are cached under ``cache_home()/aoti``, keyed by the segment's
shapes and formats, torch's version, the thread count baked into the kernels and the CPU's
instruction-set flags, each beside the SHA-256 of its bytes; a package whose bytes no longer match
or that fails to load is a miss (rebuilt), so a damaged package never runs. The first build costs
~20-30 s on a 2-core machine, a cached load ~2 s.

Why a module of our own and this route: ``torch.compile`` (dynamo) of the same segments was
1.7-5 ms per token *slower* than the eager fast path (guard checks and the Python wrapper per
call: ~20-70 us x 30 calls, more with the projections as custom ops), while the AOTInductor
package runs the same generated kernels from C++: -2 to -3 ms per token in fp32, int8 and int4
(exclusive probes, docs/notes/speed.md "Decode, round 5"). bf16 (plain bf16 matmuls on argument weights
were 4 ms slower than eager oneDNN packed ones) and int8-dynamic (fbgemm's packed parameters are
an opaque object) are not offered.

Does not own: the weights and their formats (``weights.py``), the eager step and its reference
path (``runner.py``), sampling. The batched server step never uses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from cachedrag.errors import ConfigError
from cachedrag.model.artifact import cpu_flags_digest, file_sha256, write_atomic
from cachedrag.model.rope import rotate_half
from cachedrag.model.weights import INT4_GROUP, PackedLinear

FORMAT_VERSION = 1  # bump when the segment code changes: old packages become misses
SUPPORTED = ("float32 dense", "bfloat16 + int8 weights", "bfloat16 + int4 weights")


def _kind(p: PackedLinear) -> str:
    """The exportable kernel of one projection: ``dense`` (fp32 F.linear), ``int8`` (weight-only
    ``_weight_int8pack_mm``) or ``int4``; anything else cannot be compiled here."""
    if p.kind == "dense" and p.weight is not None and p.weight.dtype == torch.float32:
        return "dense"
    if p.kind == "int8" and getattr(p, "dynamic", None) is None:
        return "int8"
    if p.kind == "int4":
        return "int4"
    raise ConfigError(f"compile=True supports {', '.join(SUPPORTED)} (bfloat16 dense and int8-dynamic decode "
                      f"faster eager, docs/notes/speed.md); this runner's projections are {p.kind!r}")


def _linear_args(p: PackedLinear) -> tuple[torch.Tensor, ...]:
    kind = _kind(p)
    if kind == "dense":
        args = (p.weight,)
    elif kind == "int8":  # row-major levels (int8 tiles: a copy read from them, held by the compiled step)
        args = (p.qweight, p.scale)
    else:
        args = p.int4.torch_layout()  # torch's kernel layout (a copy where the weight is kept as native tiles)
    return args + ((p.bias,) if p.bias is not None else ())


def _linear(kind: str, out_features: int, has_bias: bool):
    """``(fn, n)``: ``fn(x, args)`` is ``x [1, I] -> [1, O]`` through one projection's kernel, its ``n``
    tensors (``_linear_args``) as arguments."""
    def dense(x, args):
        return F.linear(x, args[0], args[1] if has_bias else None)

    def int8(x, args):
        out = torch._weight_int8pack_mm(x, args[0], args[1])  # [1, O]
        return out + args[2] if has_bias else out

    def int4(x, args):
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, args[0], INT4_GROUP, args[1])[:, :out_features]  # [1, O]
        return out + args[2] if has_bias else out

    return {"dense": dense, "int8": int8, "int4": int4}[kind], 2 + has_bias if kind != "dense" else 1 + has_bias


class _Segment(torch.nn.Module):
    """One segment as a module for ``torch.export``: ``forward(*tensors)``."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


class CompiledDecode:
    """The runner's one-token step with its static-shape parts run from AOTInductor packages."""

    def __init__(self, runner, cache_dir: str | os.PathLike | None = None):
        if runner.fast_layers is None or runner._decode_norms is None or runner.device.type != "cpu":
            raise ConfigError("compile=True needs the fast CPU decode path (fast=True, torch kernels, Llama-family "
                              "layers without q/k norms)")
        if runner._decode_dtype != runner.dtype:
            raise ConfigError(f"compile=True supports {', '.join(SUPPORTED)}")
        self.runner = runner
        lw0 = runner.fast_layers[0]
        projections = (lw0.qkv, lw0.o, lw0.gate_up, lw0.down)
        self.spec = {
            "n_heads": runner.n_heads, "n_kv_heads": runner.n_kv_heads, "head_dim": runner.head_dim,
            "hidden": lw0.qkv.in_features, "ff": lw0.ff, "q_out": lw0.q_out, "kv_out": lw0.kv_out,
            "dtype": str(runner.dtype), "act": getattr(runner.config, "hidden_act", None),
            "eps": [float(runner.layers[0].input_layernorm.variance_epsilon),
                    float(runner.layers[0].post_attention_layernorm.variance_epsilon),
                    float(runner.model.model.norm.variance_epsilon)],
            "linears": [(_kind(p), p.out_features, p.bias is not None) for p in projections],
        }
        if self.spec["act"] != "silu":
            raise ConfigError(f"compile=True supports SiLU MLPs, this model's activation is {self.spec['act']}")
        for layer, lw in zip(runner.layers, runner.fast_layers):  # one package serves all layers: same shapes
            if ([(_kind(p), p.out_features, p.bias is not None) for p in (lw.qkv, lw.o, lw.gate_up, lw.down)]
                    != self.spec["linears"]
                    or float(layer.input_layernorm.variance_epsilon) != self.spec["eps"][0]
                    or float(layer.post_attention_layernorm.variance_epsilon) != self.spec["eps"][1]):
                raise ConfigError("compile=True needs every decoder layer to have the same shapes and norms")
        self.cache_dir = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
        self.built: list[str] = []  # segments compiled (not loaded from the cache) by this instance
        self.threads = torch.get_num_threads()  # baked into the kernels' OpenMP regions (part of the key)
        self.eager_steps = 0  # steps the runner ran eagerly because the thread count changed since
        def norm_weight(norm) -> torch.Tensor:
            return norm.weight.detach().to(runner.dtype).contiguous()  # [Dm]

        self._pre_args = [(norm_weight(layer.input_layernorm), *_linear_args(lw.qkv))
                          for layer, lw in zip(runner.layers, runner.fast_layers)]
        self._post_args = [(norm_weight(layer.post_attention_layernorm), *_linear_args(lw.o), *_linear_args(lw.gate_up),
                            *_linear_args(lw.down)) for layer, lw in zip(runner.layers, runner.fast_layers)]
        self._final_norm = norm_weight(runner.model.model.norm)
        self.first, self.mid, self.last = (self._load(name) for name in ("first", "mid", "last"))

    # ------------------------------------------------------------------ the step
    def step(self, token_id: int, position: int, kv) -> torch.Tensor:
        """``ModelRunner.decode_step`` for one token at ``position`` (capacity checked by the caller):
        logits ``[V]``."""
        r = self.runner
        hidden = r.embed(torch.tensor([token_id], device=r.device))  # [1, Dm]
        cos, sin = r.rotary.cos_sin(torch.tensor([position]), r.dtype, r.device)  # [1, D] each
        q, k, v = self.first(hidden, cos, sin, *self._pre_args[0])  # [1, H_q, 1, D], [H_kv, D], [H_kv, D]
        n = r.n_layers
        for i in range(n):
            kv.k[i, :, position] = k  # [H_kv, D]
            kv.v[i, :, position] = v
            out = r._attend_row(i, q[0, :, 0], position, kv).view(q.shape)  # [1, H_q, 1, D] (runner's choice)
            if i + 1 < n:
                hidden, q, k, v = self.mid(hidden, out, cos, sin, *self._post_args[i], *self._pre_args[i + 1])
            else:
                hidden = self.last(hidden, out, *self._post_args[i], self._final_norm)  # [1, Dm] normalised
        kv.length = max(kv.length, position + 1)
        return r.fast_head(hidden).float()[0]  # [V]

    # ------------------------------------------------------------------ segments
    def _functions(self):
        s = self.spec
        h_q, h_kv, d, ff = s["n_heads"], s["n_kv_heads"], s["head_dim"], s["ff"]
        n_qk = s["q_out"] + s["kv_out"]
        eps1, eps2, eps_f = s["eps"]
        (qkv, n_qkv), (o, n_o), (gu, n_gu), (down, n_down) = (_linear(*spec) for spec in s["linears"])

        def rms(x, w, eps):  # LlamaRMSNorm's arithmetic (inductor keeps float32 inside one fused kernel)
            xf = x.float()  # [1, Dm]
            return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

        def pre(hidden, cos, sin, w1, *lin):
            y = qkv(rms(hidden, w1, eps1), lin)[0]  # [Oq + 2*Okv]
            qk = y[:n_qk].view(h_q + h_kv, 1, d)  # [H_q + H_kv, 1, D]
            qk = qk * cos + rotate_half(qk) * sin  # [H_q + H_kv, 1, D] RoPE at the position
            return qk[None, :h_q], qk[h_q:, 0], y[n_qk:].view(h_kv, d)  # [1, H_q, 1, D], [H_kv, D], [H_kv, D]

        def post(hidden, attn, w2, *lin):
            h = hidden + o(attn.reshape(1, -1), lin[:n_o])  # [1, Dm]
            g = gu(rms(h, w2, eps2), lin[n_o:n_o + n_gu])  # [1, 2*Dff]
            return h + down(F.silu(g[:, :ff]) * g[:, ff:], lin[n_o + n_gu:])  # [1, Dm]

        n_post = 1 + n_o + n_gu + n_down

        def first(hidden, cos, sin, *pre_args):
            return pre(hidden, cos, sin, *pre_args)

        def mid(hidden, attn, cos, sin, *args):
            h = post(hidden, attn, *args[:n_post])
            return (h, *pre(h, cos, sin, *args[n_post:]))

        def last(hidden, attn, *args):
            return rms(post(hidden, attn, *args[:n_post]), args[n_post], eps_f)

        assert n_qkv + 1 == len(self._pre_args[0]) and n_post == len(self._post_args[0])
        return {"first": first, "mid": mid, "last": last}

    def _example(self, name: str) -> tuple[torch.Tensor, ...]:
        r = self.runner
        hidden = torch.zeros(1, self.spec["hidden"], dtype=r.dtype)  # [1, Dm]
        attn = torch.zeros(1, r.n_heads, 1, r.head_dim, dtype=r.dtype)  # [1, H_q, 1, D]
        cos, sin = r.rotary.cos_sin(torch.tensor([0]), r.dtype, r.device)  # [1, D] each
        last = len(self._post_args) - 1
        if name == "first":
            return (hidden, cos, sin, *self._pre_args[0])
        if name == "mid":
            return (hidden, attn, cos, sin, *self._post_args[0], *self._pre_args[min(1, last)])
        return (hidden, attn, *self._post_args[last], self._final_norm)

    def key(self, name: str) -> str:
        """Cache key of one segment's package: what the generated code depends on."""
        blob = json.dumps({"segment": name, "spec": self.spec, "version": FORMAT_VERSION, "torch": torch.__version__,
                           "threads": self.threads, "cpu": cpu_flags_digest(), "machine": platform.machine()},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:20]

    def _load(self, name: str):
        path = self.cache_dir / f"decode-{name}-{self.key(name)}.pt2"
        digest = path.with_suffix(".sha256")
        if path.exists():
            try:  # a package whose bytes changed since its build (bit rot, a truncated copy) is a miss:
                if digest.read_text().strip() != file_sha256(path):  # its kernels must never run
                    raise ValueError("package digest mismatch")
                return torch._inductor.aoti_load_package(str(path))
            except Exception:  # a damaged or foreign package is a miss: rebuild it below  # noqa: BLE001
                path.unlink(missing_ok=True)
        self._build(name, path, digest)
        self.built.append(name)
        return torch._inductor.aoti_load_package(str(path))

    def _build(self, name: str, path: Path, digest: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with torch.no_grad():
            program = torch.export.export(_Segment(self._functions()[name]), self._example(name), strict=False)
            fd, tmp = tempfile.mkstemp(suffix=".pt2", dir=path.parent)
            os.close(fd)
            try:
                torch._inductor.aoti_compile_and_package(program, package_path=tmp)
                write_atomic(digest, file_sha256(Path(tmp)))  # the digest first: a package never lacks it
                os.replace(tmp, path)  # atomic: a half-written package is never loaded
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)



def _default_cache_dir() -> Path:
    from cachedrag.paths import cache_home

    return cache_home() / "aoti"

