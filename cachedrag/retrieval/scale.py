"""A million-vector retrieval corpus: real chunk embeddings plus synthetic distractors around them.

Owns: ``DistractorSource`` (a deterministic ``VectorSource``), ``ScaleIndex`` (an on-disk IVF
over it, with a chunk text for every row) and ``build_scale_index`` / ``scale_index_dir``
(built once under the cache home, resumable). Does not own: the IVF files (``disk_ivf``) or the
real chunks (``index.build_index``).

How the vectors are made. Rows ``0 .. n_real - 1`` are the real, normalised MiniLM embeddings
of a corpus's chunks (the stdlib docs: 884 chunks of 256 SmolLM2 tokens). Every other row is a
distractor: two real chunks ``p1``, ``p2`` drawn uniformly, a mix weight ``t ~ U(0, mix_max)``
and a noise scale ``sigma ~ U(sigma_min, sigma_max)``;
``v = normalize((1 - t) x[p1] + t x[p2] + sigma g)`` with ``g ~ N(0, I_d)``. So distractors fill
the space around and between real chunks (cosine to the mix about 0.4-0.75), which makes the
IVF clusters and the top-10 of real questions as crowded as a large corpus of near-duplicates
would. The rows are generated in fixed groups of ``GROUP_ROWS`` from ``(seed, group)``, so any
block can be regenerated exactly (the build reads the source several times and can resume).

Text of a row: a real row's chunk text; a distractor's text is its ``p1`` chunk's text
behind a one-line marker (``[near-duplicate of <chunk id>, variant <row>]``), so every row is a
distinct chunk of realistic length for the LLM (its own chunk-cache key and prefill cost).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from cachedrag.retrieval.config import DiskIndexConfig
from cachedrag.retrieval.disk_ivf import DiskIVF, build_disk_ivf

GROUP_ROWS = 4096
SCALE_FILE = "scale.json"


class DistractorConfig(BaseModel):
    """How distractor vectors are drawn around the real ones."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ntotal: int = Field(1_000_000, ge=1, description="rows of the index, real ones included")
    seed: int = Field(20, description="seed of the distractor generator")
    mix_max: float = Field(1.0, ge=0.0, le=1.0, description="largest weight of the second parent")
    sigma_min: float = Field(0.05, ge=0.0, description="smallest noise scale per coordinate")
    sigma_max: float = Field(0.12, ge=0.0, description="largest noise scale per coordinate")


class DistractorSource:
    """Real vectors first, then deterministic distractors (see the module docstring)."""

    def __init__(self, real: np.ndarray, config: DistractorConfig | None = None):
        self.config = config or DistractorConfig()
        self.real = np.ascontiguousarray(real, dtype=np.float32)  # [n_real, d]
        self.n_real, self.dim = self.real.shape
        self.ntotal = max(self.config.ntotal, self.n_real)

    def block(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` -> float32 ``[stop - start, d]``."""
        assert 0 <= start < stop <= self.ntotal, (start, stop, self.ntotal)
        parts = []
        if start < self.n_real:
            parts.append(self.real[start:min(stop, self.n_real)])
        lo = max(start, self.n_real)
        while lo < stop:
            g = self._group_of(lo)
            g_start = self.n_real + g * GROUP_ROWS
            hi = min(stop, g_start + GROUP_ROWS)
            parts.append(self._group(g)[0][lo - g_start:hi - g_start])
            lo = hi
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def parents(self, rows) -> np.ndarray:
        """The real chunk behind each row (itself for a real row)."""
        rows = np.asarray(rows, dtype=np.int64)
        out = rows.copy()
        for i, r in enumerate(rows.tolist()):
            if r >= self.n_real:
                out[i] = self._first_parents(self._group_of(r))[(r - self.n_real) % GROUP_ROWS]
        return out

    def _group_of(self, row: int) -> int:
        return (row - self.n_real) // GROUP_ROWS

    def _first_parents(self, g: int) -> np.ndarray:
        """``p1`` of group ``g`` (the generator's first draw, so no vectors are made)."""
        return np.random.default_rng([self.config.seed, g]).integers(0, self.n_real, GROUP_ROWS)

    def _group(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """Distractor group ``g``: vectors ``[GROUP_ROWS, d]`` and first parents ``[GROUP_ROWS]``."""
        c = self.config
        rng = np.random.default_rng([c.seed, g])
        p1 = rng.integers(0, self.n_real, GROUP_ROWS)
        p2 = rng.integers(0, self.n_real, GROUP_ROWS)
        t = rng.uniform(0.0, c.mix_max, GROUP_ROWS).astype(np.float32)[:, None]
        sigma = rng.uniform(c.sigma_min, c.sigma_max, GROUP_ROWS).astype(np.float32)[:, None]
        noise = rng.standard_normal((GROUP_ROWS, self.dim), dtype=np.float32)  # [G, d]
        v = (1 - t) * self.real[p1] + t * self.real[p2] + sigma * noise  # [G, d]
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        return v.astype(np.float32), p1

    def info(self) -> dict:
        return {"kind": "real chunk embeddings + distractors", "n_real": self.n_real, **self.config.model_dump()}


class ScaleIndex:
    """An on-disk IVF over a ``DistractorSource`` with the chunk text of every row."""

    def __init__(self, path: Path, base, ivf: DiskIVF, source: DistractorSource):
        self.path = path
        self.base = base  # RetrievalIndex of the real chunks (embedder, chunk records)
        self.ivf = ivf
        self.source = source

    @property
    def n_real(self) -> int:
        return self.source.n_real

    def text(self, row: int) -> str:
        """The chunk text of index row ``row`` (see the module docstring)."""
        if row < self.n_real:
            return self.base.chunks[row].text
        parent = self.base.chunks[int(self.source.parents([row])[0])]
        return f"[near-duplicate of {parent.id}, variant {row}]\n{parent.text}"

    def texts(self, rows) -> list[str]:
        return [self.text(int(r)) for r in rows if int(r) >= 0]

    def embed(self, queries):
        return self.base.embed(queries)

    def hits(self, scores, ids) -> list:
        """``(scores [B, k], ids [B, k])`` -> ranked ``Hit`` lists, as ``RetrievalIndex.hits``
        (so pipeline retrievers run over this index); a distractor's chunk is its parent's
        record with id ``scale/<row>`` and the marked text of ``text(row)``."""
        from cachedrag.retrieval.index import Hit

        out = []
        for row_scores, row_ids in zip(scores.tolist(), ids.tolist()):
            out.append([Hit(rank=r, score=sc, row=i, chunk=self._chunk(i))
                        for r, (sc, i) in enumerate(zip(row_scores, row_ids)) if i >= 0])
        return out

    def _chunk(self, row: int):
        if row < self.n_real:
            return self.base.chunks[row]
        parent = self.base.chunks[int(self.source.parents([row])[0])]
        return replace(parent, id=f"scale/{row}", text=self.text(row))


def stdlib_base_index(progress: bool = True):
    """The stdlib corpus's real-chunk index under the cache home (built once with the default
    LLM tokenizer and embedder; reused afterwards, since its pydoc text varies across Pythons)."""
    from cachedrag.paths import cache_home
    from cachedrag.retrieval.index import load_index

    path = cache_home() / "indexes" / "stdlib"
    if (path / "manifest.json").is_file():
        return load_index(path)
    from cachedrag.corpus import stdlib_corpus
    from cachedrag.retrieval.chunker import load_tokenizer
    from cachedrag.retrieval.embedder import Embedder
    from cachedrag.retrieval.index import build_index

    return build_index(stdlib_corpus(), load_tokenizer(), Embedder(), out=path, progress=progress)


def scale_index_dir(ntotal: int) -> Path:
    """Where the scale index of ``ntotal`` rows lives under the cache home."""
    from cachedrag.paths import cache_home

    return cache_home() / "indexes" / f"scale-{ntotal}"


def build_scale_index(base, out: str | Path, distractors: DistractorConfig | None = None,
                      config: DiskIndexConfig | None = None, progress: bool = True) -> ScaleIndex:
    """Build (or resume, or reuse) the scale index of ``base``'s real chunks at ``out``.

    ``base`` is a saved ``RetrievalIndex`` (its vectors are the real rows, in chunk order).
    """
    out = Path(out)
    distractors = distractors or DistractorConfig()
    real = np.empty((base.ivf.ntotal, base.ivf.dim), dtype=np.float32)
    real[base.ivf.ids.numpy()] = base.ivf.vectors.numpy()  # chunk order
    source = DistractorSource(real, distractors)
    out.mkdir(parents=True, exist_ok=True)
    record = {"base": str(base.path), "distractors": distractors.model_dump(), "n_real": source.n_real}
    meta = out / SCALE_FILE
    if meta.is_file() and json.loads(meta.read_text()) != record:
        raise ValueError(f"{out} holds a scale index of other settings; remove it to rebuild")
    meta.write_text(json.dumps(record, indent=2))
    build_disk_ivf(source, out / "ivf", config, progress=progress, source_info=source.info())
    return ScaleIndex(out, base, DiskIVF.open(out / "ivf"), source)
