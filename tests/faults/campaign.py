"""The fault campaign: a bounded, randomized fault-injection run over a real chunk-cache store.

Owns: the campaign — a tiny random-weight engine over a disk (and, where a redis-server can
run, a Redis) chunk-cache store, answering requests in ``prefix`` mode, whose answers must
equal a full recompute token for token — and its fault injectors: crafted valid-checksum
entries of every wrong shape, bit flips and truncations, odd files planted in the cache
directory (FIFOs, dangling symlinks, huge sparse files, foreign temp files, symlinked
shards), ``kill -9`` of forked writers, engines and index builds at random moments, failed
renames injected through the index swap's seams, a second owner of the directory, deletes
on a read-only disk, a Redis that accepts and never answers, malformed Redis accounting and
another process evicting Redis values mid-request. Does not own: the fixes (``store``,
``retrieval.index``, the engine's load-path checks). ``test_campaign.py`` beside it runs every
injector a few times, and a shorter mixed campaign (``slow``); a full campaign runs as a script.

After every fault it checks: answers equal the full recompute (``wrong_answers``), the
serving path raised nothing (``crashes``), every request finished within ``--timeout-s``
(``hangs``), every tier within its budget and the on-disk bytes of our files within the
disk budget (``budget_overruns``), none of our temp files or build directories survive the
next start (``leaked_files``), planted foreign things unchanged (``foreign_touched``), and
the store's index agrees with its tiers (``invariant_violations``).

    python tests/faults/campaign.py --json faults.json   # default: 120 rounds, seed 0 (exit 1 on a failure)
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

KINDS = (
    "crafted_shape", "bit_flip", "truncate", "odd_file", "kill_writer", "kill_engine", "kill_index_build",
    "rename_failure", "second_writer", "readonly_remove", "hanging_redis", "redis_malformed", "redis_other_eviction",
)
REDIS_KINDS = ("redis_malformed", "redis_other_eviction")
MUST_BE_ZERO = ("wrong_answers", "crashes", "hangs", "budget_overruns", "leaked_files", "foreign_touched",
                "invariant_violations")
SYSTEM = "You answer from the documents."
_WORDS = ["red", "blue", "green", "cyan", "gold", "pink", "teal", "gray"]
_TEMP = re.compile(r"\.[0-9a-f]{2,128}\.cachedrag-[0-9]+-[0-9a-f]{16}\.tmp")
_ENTRY = re.compile(r"[0-9a-f]{2,128}\.safetensors")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=120, help="faults to inject (one per round)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KINDS), help="subset of " + ",".join(KINDS))
    parser.add_argument("--timeout-s", type=float, default=20.0, help="a request slower than this is a hang")
    parser.add_argument("--requests-per-fault", type=int, default=2, help="requests checked after each fault")
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed)")
    parser.add_argument("--no-redis", action="store_true", help="skip the kinds that need a real redis-server")
    parser.add_argument("--json", dest="json_out", help="write results as JSON to this path")


@dataclass
class Tally:
    faults_injected: int = 0
    requests_checked: int = 0
    wrong_answers: int = 0
    crashes: int = 0
    hangs: int = 0
    budget_overruns: int = 0
    leaked_files: int = 0
    foreign_touched: int = 0
    invariant_violations: int = 0
    per_kind: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # the first few problems, described

    current: str = ""  # the kind being injected

    def fail(self, counter: str, what: str) -> None:
        setattr(self, counter, getattr(self, counter) + 1)
        if len(self.failures) < 30:
            self.failures.append(f"{counter} [{self.current}]: {what}")


class StubEmbedder:
    """Deterministic hash vectors: index builds in the campaign need no embedding model."""

    name = "cachedrag-faults/hash-embedder"
    dim = 16

    def encode(self, texts, progress: bool = False) -> np.ndarray:
        out = np.stack([np.frombuffer(hashlib.sha256(t.encode()).digest()[: self.dim], dtype=np.uint8)
                        for t in texts]).astype(np.float32)  # [N, d]
        return out / np.linalg.norm(out, axis=1, keepdims=True).clip(1e-6)

    def check_compatible(self, name: str, dim: int) -> None:
        pass


class HangingServer:
    """A TCP server that accepts connections and never answers (a wedged Redis)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.url = f"redis://127.0.0.1:{self.sock.getsockname()[1]}/0"
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="hanging-redis", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                self._conns.append(self.sock.accept()[0])  # held open, never answered
            except OSError:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for c in self._conns:
            c.close()
        self.sock.close()


def snapshot(path: Path) -> tuple | None:
    """What a foreign thing looks like now (type, size, mtime, link target or content hash)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return ("link", os.readlink(path))
    if stat.S_ISREG(st.st_mode) and st.st_size < 1 << 20:
        return ("file", st.st_size, st.st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
    return (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns)


def our_bytes(directory: Path) -> int:
    """Allocated bytes of our files (entries and temp files) in the real shard directories."""
    total = 0
    for shard in directory.iterdir() if directory.is_dir() else []:
        if not (len(shard.name) == 2 and shard.is_dir() and not shard.is_symlink()):
            continue
        for f in shard.iterdir():
            if (_ENTRY.fullmatch(f.name) or _TEMP.fullmatch(f.name)) and stat.S_ISREG(os.lstat(f).st_mode):
                total += os.lstat(f).st_blocks * 512
    return total


def our_temp_files(directory: Path) -> list[Path]:
    out = []
    for shard in directory.iterdir() if directory.is_dir() else []:
        if len(shard.name) == 2 and shard.is_dir() and not shard.is_symlink():
            out += [f for f in shard.iterdir() if _TEMP.fullmatch(f.name)]
    return out


def bounded(fn, timeout_s: float):
    """Run ``fn`` in a daemon thread: ``("ok", value)``, ``("error", exc)`` or ``("hang", None)``."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # reported as a crash by the caller
            box["error"] = exc

    t = threading.Thread(target=target, name="faults-request", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return "hang", None
    if "error" in box:
        return "error", box["error"]
    return "ok", box["value"]


def fork_and_kill(child, delay_s: float) -> None:
    """Fork a process running ``child()``, ``kill -9`` it after ``delay_s``, reap it."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into the campaign
        code = 0
        try:
            child()
        except BaseException:
            code = 1
        os._exit(code)
    time.sleep(delay_s)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


class Campaign:
    """One engine + store under a stream of faults (see the module docstring)."""

    def __init__(self, root: Path, runner, *, seed: int = 0, timeout_s: float = 20.0, requests_per_fault: int = 2,
                 redis_url: str | None = None) -> None:
        from cachedrag.engine import CachedEngine
        from cachedrag.fingerprint import namespace_for

        self.root = root
        self.runner = runner
        self.layerwise = True
        self.cpu = False
        self.rng = random.Random(seed)
        self.timeout_s = timeout_s
        self.per_fault = requests_per_fault
        self.redis_url = redis_url
        self.tally = Tally()
        self.namespace = namespace_for(runner.model, runner.tokenizer, None).digest
        self.disk_dir = root / "disk"
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        self.outside = root / "outside"  # not ours: symlink targets, planted files
        self.outside.mkdir(exist_ok=True)
        self.foreign: dict[Path, tuple | None] = {}
        self._plant_foreign()
        rng = random.Random(seed + 1)
        docs = [f"Doc {i}: " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 9))) for i in range(10)]
        self.requests = [(rng.sample(docs, rng.randint(1, 3)), rng.choice(["Which colors?", "Any gold?", "Count."]))
                         for _ in range(10)]
        full = CachedEngine(runner, config=self._config("full"))
        self.reference = [self._ask(full, r).token_ids for r in self.requests]
        entry_bytes = 2 * runner.n_layers * runner.n_kv_heads * 40 * runner.head_dim * 4
        self.disk_budget = 14 * max(entry_bytes, 4096)  # small: evictions happen
        self.engine = self.store = None
        self._open()
        self._index_pair = None

    # ---- engine and store --------------------------------------------------------------
    def _config(self, mode: str = "prefix"):
        from cachedrag.config import EngineConfig

        return EngineConfig(mode=mode, break_even_factor=1e6, layerwise_loading=self.layerwise)

    def _store_config(self, **extra):
        from cachedrag.store.config import StoreConfig

        kw = {"disk_dir": self.disk_dir, "disk_bytes": self.disk_budget, "disk_fsync": False, "write_through": True}
        if self.cpu:
            kw["cpu_bytes"] = self.disk_budget // 4
        kw.update(extra)
        return StoreConfig(namespace=self.namespace, **kw)

    def _open(self) -> None:
        """(Re)start the engine over the disk directory, as a restarted process would."""
        from cachedrag.engine import CachedEngine
        from cachedrag.store.tiered import TieredStore

        self.layerwise = self.rng.random() < 0.6
        self.cpu = self.rng.random() < 0.4
        self.store = TieredStore.from_config(self._store_config())
        self.engine = CachedEngine(self.runner, config=self._config(), store=self.store)
        leftovers = our_temp_files(self.disk_dir)
        if leftovers:
            self.tally.fail("leaked_files", f"temp files survived a start: {[p.name for p in leftovers]}")

    def _close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.store = self.engine = None

    def _ask(self, engine, request):
        chunks, question = request
        return engine.generate(chunks, question, SYSTEM, max_new_tokens=3)

    # ---- checks ------------------------------------------------------------------------
    def serve(self, n: int | None = None, engine=None, store=None, redis_tiers=()) -> None:
        """Answer ``n`` random requests; check each answer, time, budgets, invariants."""
        engine = engine or self.engine
        store = store or self.store
        for _ in range(n or self.per_fault):
            i = self.rng.randrange(len(self.requests))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                status, value = bounded(lambda: self._ask(engine, self.requests[i]), self.timeout_s)
            self.tally.requests_checked += 1
            if status == "hang":
                self.tally.fail("hangs", f"request {i} took more than {self.timeout_s} s")
            elif status == "error":
                self.tally.fail("crashes", f"request {i}: {type(value).__name__}: {value}"[:300])
            elif value.token_ids != self.reference[i]:
                self.tally.fail("wrong_answers", f"request {i}: {value.token_ids} != {self.reference[i]} "
                                f"(notes {value.notes[:3]})")
            self.check(store, redis_tiers)

    def check(self, store=None, redis_tiers=()) -> None:
        store = store or self.store
        if not store.wait_prefetches(self.timeout_s):  # the request's background promotions write tiers too
            self.tally.fail("hangs", f"promotions still running after {self.timeout_s} s")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for tier in store.tiers:
                if tier.used_bytes > tier.budget_bytes:
                    self.tally.fail("budget_overruns", f"{tier.name}: {tier.used_bytes} > {tier.budget_bytes}")
            for tier in redis_tiers:
                self._check_redis(tier)
            problems = store.check_invariants()
        if any(t.name == "disk" for t in store.tiers):
            on_disk = our_bytes(self.disk_dir)
            if on_disk > self.disk_budget:
                self.tally.fail("budget_overruns", f"disk: {on_disk} bytes of our files > {self.disk_budget}")
        if problems:
            self.tally.fail("invariant_violations", "; ".join(problems)[:300])
        for path, before in self.foreign.items():
            if snapshot(path) != before:
                self.tally.fail("foreign_touched", f"{path} changed: {before} -> {snapshot(path)}")
                self.foreign[path] = snapshot(path)

    def _check_redis(self, tier) -> None:
        import redis

        client = tier.client
        prefix = tier._prefix
        try:
            sizes = {k: int(v) for k, v in client.hgetall(f"{prefix}:__sizes").items()}
            used = int(client.get(f"{prefix}:__used") or 0)
        except (redis.ResponseError, ValueError):
            return  # still malformed: no script has run since (nothing was written); the next one repairs it
        real = sum(client.memory_usage(k) or 0 for k in sizes)
        if used > tier.budget_bytes or real > tier.budget_bytes:
            self.tally.fail("budget_overruns", f"redis: used {used}, real {real} > {tier.budget_bytes}")
        values = [k for k in client.scan_iter(match=f"{prefix}:*") if not k.startswith(f"{prefix}:__".encode())]
        outside = [k for k in values if k not in sizes]
        if outside:
            self.tally.fail("budget_overruns", f"redis: {len(outside)} values outside the accounting")

    # ---- foreign things ----------------------------------------------------------------
    def _plant_foreign(self) -> None:
        (self.disk_dir / "README.txt").write_text("notes of the operator")
        (self.outside / "precious.bin").write_bytes(os.urandom(300))
        for p in (self.disk_dir / "README.txt", self.outside / "precious.bin"):
            self.foreign[p] = snapshot(p)

    def _random_key(self) -> str:
        return "%064x" % self.rng.getrandbits(256)

    # ---- the faults --------------------------------------------------------------------
    def inject(self, kind: str) -> None:
        self.tally.faults_injected += 1
        self.tally.current = kind
        self.tally.per_kind[kind] = self.tally.per_kind.get(kind, 0) + 1
        getattr(self, f"_fault_{kind}")()

    def _stored_keys(self) -> list[str]:
        if not self.store.keys():
            self.serve(2)
        return sorted(self.store.keys())

    def _fault_crafted_shape(self) -> None:
        import torch

        from cachedrag.store.entry import KVEntry

        keys = self._stored_keys()
        if not keys:
            return
        key = self.rng.choice(keys)
        entry = self.store.get(key, promote=False)
        if entry is None:
            return
        how = self.rng.choice(["layers", "kv_heads", "tokens", "head_dim", "dtype", "extra_layer"])
        crafts = {
            "layers": lambda t: t[:-1],  # [L-1, H, T, D]
            "kv_heads": lambda t: t[:, :-1],  # [L, H-1, T, D]
            "tokens": lambda t: t[:, :, :-1],  # [L, H, T-1, D]
            "head_dim": lambda t: t[..., :-1],  # [L, H, T, D-1]
            "dtype": lambda t: t.to(torch.float16),
            "extra_layer": lambda t: torch.cat([t, t[:1]]),  # [L+1, H, T, D]
        }
        tensors = dict(entry.tensors)
        tensors["k"] = crafts[how](entry.k.clone())
        tensors["v"] = crafts[how](entry.v.clone())
        self.store.put(key, KVEntry(tensors, dict(entry.meta)), replace=True)  # valid checksums, wrong shape
        self.serve()

    def _disk_files(self) -> list[Path]:
        tier = self.store.tier("disk")
        return [tier.path(k) for k in tier.keys() if tier.path(k).is_file()]

    def _fault_bit_flip(self) -> None:
        files = self._disk_files() or (self.serve(2) or self._disk_files())
        if not files:
            return
        path = self.rng.choice(files)
        size = path.stat().st_size
        with open(path, "r+b") as f:
            at = self.rng.randrange(size)
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ (1 << self.rng.randrange(8))]))
        if self.rng.random() < 0.5:
            self._close()
            self._open()
        self.serve()

    def _fault_truncate(self) -> None:
        files = self._disk_files() or (self.serve(2) or self._disk_files())
        if not files:
            return
        path = self.rng.choice(files)
        os.truncate(path, self.rng.randrange(path.stat().st_size))
        if self.rng.random() < 0.5:
            self._close()
            self._open()
        self.serve()

    def _fault_odd_file(self) -> None:
        self._close()
        key = self._random_key()
        shard = self.disk_dir / key[:2]
        what = self.rng.choice(["fifo", "dangling_symlink", "sparse", "foreign_tmp", "symlinked_shard", "dir"])
        if what == "symlinked_shard":
            target = self.outside / f"shard-{key[:8]}"
            target.mkdir(exist_ok=True)
            behind = target / f"{key}.safetensors"
            behind.write_bytes(b"behind a link, not ours")
            tmp = target / f".{key}.cachedrag-1-0123456789abcdef.tmp"
            tmp.write_bytes(b"named like ours, behind a link")
            for p in (behind, tmp):
                self.foreign[p] = snapshot(p)
            if not os.path.lexists(shard):
                os.symlink(target, shard)
                self.foreign[shard] = snapshot(shard)
        else:
            if os.path.islink(shard):
                shard = self.disk_dir / "00"
                key = "00" + key[2:]
            shard.mkdir(exist_ok=True)
            path = shard / f"{key}.safetensors"
            if what == "fifo":
                os.mkfifo(path)
            elif what == "dangling_symlink":
                os.symlink(self.root / "nowhere" / key, path)
            elif what == "sparse":
                with open(path, "wb") as f:
                    f.truncate(64 << 30)
            elif what == "dir":
                path.mkdir()
            else:
                path = shard / self.rng.choice([f".{key}.abc123.tmp", "x.tmp", f".{key}.cachedrag-x.tmp"])
                path.write_bytes(b"someone else's temp file")
            self.foreign[path] = snapshot(path)
        status, value = bounded(self._open, self.timeout_s)
        if status == "hang":
            self.tally.fail("hangs", f"start-up with a planted {what}")
            raise RuntimeError("the store did not start")
        if status == "error":
            self.tally.fail("crashes", f"start-up with a planted {what}: {value!r}"[:300])
            self._open()
        self.serve()

    def _writer_child(self, budget: int) -> None:
        from cachedrag.store.disk import DiskTier

        tier = DiskTier(self.disk_dir, budget, namespace=self.namespace, fsync=False)
        blobs = self._junk_blobs
        while True:
            for key, blob in blobs:
                tier.commit(_prepared(tier, key, blob))

    def _fault_kill_writer(self) -> None:
        self._ensure_junk()
        self._close()
        fork_and_kill(lambda: self._writer_child(self.disk_budget), self.rng.uniform(0.0, 0.25))
        self._open()
        self.serve()

    def _ensure_junk(self) -> None:
        if getattr(self, "_junk_blobs", None) is None:
            import torch

            from cachedrag.store.codec import encode
            from cachedrag.store.entry import KVEntry

            r = self.runner
            blobs = []
            for i in range(6):
                key = self._random_key()
                t = torch.randn(r.n_layers, r.n_kv_heads, 8 + i, r.head_dim)  # [L, H_kv, T, D]
                blobs.append((key, encode(key, KVEntry({"k": t, "v": t.clone()}, {"namespace": self.namespace}),
                                          self.namespace)))
            self._junk_blobs = blobs

    def _engine_child(self) -> None:
        from cachedrag.engine import CachedEngine
        from cachedrag.store.tiered import TieredStore

        store = TieredStore.from_config(self._store_config())
        engine = CachedEngine(self.runner, config=self._config(), store=store)
        rng = random.Random(os.getpid())
        while True:
            self._ask(engine, rng.choice(self.requests))

    def _fault_kill_engine(self) -> None:
        self._close()
        fork_and_kill(self._engine_child, self.rng.uniform(0.05, 0.8))
        self._open()
        self.serve()

    def _indexes(self):
        if self._index_pair is None:
            from cachedrag.corpus import Document
            from cachedrag.retrieval.config import ChunkConfig, IndexConfig, RetrievalConfig
            from cachedrag.retrieval.index import build_index

            cfg = RetrievalConfig(chunk=ChunkConfig(chunk_tokens=24, overlap=0), index=IndexConfig(nlist=2))
            docs = [Document(f"d{i}", " ".join(chunks) + " " + q) for i, (chunks, q) in enumerate(self.requests)]
            a = build_index(docs[:5], self.runner.tokenizer, StubEmbedder(), cfg, progress=False)
            b = build_index(docs[4:], self.runner.tokenizer, StubEmbedder(), cfg, progress=False)
            self._index_pair = (a, b)
            self.index_path = self.root / "index"
            a.save(self.index_path)
        return self._index_pair

    def _check_index(self, allowed) -> None:
        from cachedrag.retrieval.index import load_index
        from cachedrag.retrieval.index_files import BUILD_TAG

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                got = load_index(self.index_path)
        except Exception as exc:  # the path must always hold a complete index
            self.tally.fail("crashes", f"index at the path does not load: {exc!r}"[:300])
            return
        self.tally.requests_checked += 1
        match = [idx for idx in allowed if [c.id for c in got.chunks] == [c.id for c in idx.chunks]]
        if not match:
            self.tally.fail("wrong_answers", "the index at the path is neither the old nor the new one")
        else:
            q = StubEmbedder().encode([r[1] + " " + r[0][0] for r in self.requests[:4]])  # [4, d]
            got_ids = [[h.chunk.id for h in row] for row in got.search(q, k=3, nprobe=2)]
            want_ids = [[h.chunk.id for h in row] for row in match[0].search(q, k=3, nprobe=2)]
            if got_ids != want_ids:
                self.tally.fail("wrong_answers", "search over the loaded index differs from the index saved")
        a, _ = self._indexes()
        import copy

        copy.copy(a).save(self.index_path)  # the next build cleans what dead builds left
        left = [p for p in self.index_path.parent.iterdir() if p.name.startswith(f".{self.index_path.name}{BUILD_TAG}")]
        if left:
            self.tally.fail("leaked_files", f"build leftovers after the next save: {[p.name for p in left]}")

    def _fault_kill_index_build(self) -> None:
        import copy

        a, b = self._indexes()

        def child():
            while True:
                for idx in (b, a):
                    copy.copy(idx).save(self.index_path)

        fork_and_kill(child, self.rng.uniform(0.0, 0.4))
        self._check_index((a, b))

    def _fault_rename_failure(self) -> None:
        import copy

        from cachedrag.retrieval import index_files as index_mod

        a, b = self._indexes()
        real_exchange, real_rename = index_mod._exchange, index_mod._rename
        calls = []

        def broken_exchange(x, y):
            raise OSError(self.rng.choice([errno.EIO, errno.ENOSYS]), "injected exchange failure")

        def flaky_rename(src, dst):
            calls.append(src)
            if len(calls) == 2:
                raise OSError(errno.EIO, "injected rename failure")
            real_rename(src, dst)

        index_mod._exchange, index_mod._rename = broken_exchange, flaky_rename
        try:
            copy.copy(b).save(self.index_path)
            self.tally.fail("crashes", "a save with a failing rename reported success")
        except OSError:
            pass
        finally:
            index_mod._exchange, index_mod._rename = real_exchange, real_rename
        self._check_index((a,))  # a failed swap leaves the old index

    def _fault_second_writer(self) -> None:
        from cachedrag.errors import DirectoryInUseError
        from cachedrag.store.tiered import TieredStore

        try:
            other = TieredStore.from_config(self._store_config())
        except DirectoryInUseError:
            other = None
        if other is not None:
            self.tally.fail("budget_overruns", "a second store opened the same disk directory")
            other.close()

        def child():
            from cachedrag.store.disk import DiskTier

            try:
                DiskTier(self.disk_dir, self.disk_budget, namespace=self.namespace)
            except DirectoryInUseError:
                os._exit(3)
            os._exit(0)

        pid = os.fork()
        if pid == 0:
            try:
                child()
            finally:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 3:
            self.tally.fail("budget_overruns", "a second process opened the same disk directory")
        self.serve()

    def _fault_readonly_remove(self) -> None:
        keys = self.store.tier("disk").keys() or (self.serve(2) or self.store.tier("disk").keys())
        if not keys:
            return
        disk = self.store.tier("disk")
        key = self.rng.choice(keys)

        def read_only(path):
            raise OSError(errno.EROFS, "Read-only file system (injected)", str(path))

        disk._unlink = read_only
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                removed = self.store.remove(key)
            if removed and disk.path(key).exists():
                self.tally.fail("invariant_violations", "remove() reported success on a read-only disk")
            self.check()
            self.serve(1)
        finally:
            del disk._unlink
        self.serve(1)

    def _fault_hanging_redis(self) -> None:
        from cachedrag.engine import CachedEngine
        from cachedrag.store.tiered import TieredStore

        server = HangingServer()
        self._close()
        try:
            store = TieredStore.from_config(self._store_config(
                redis_url=server.url, redis_bytes=1 << 20, redis_timeout_s=0.2, redis_breaker_failures=2,
                redis_breaker_reset_s=30.0, redis_prefix=f"cdfaults{self.rng.getrandbits(32):08x}"))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                status, engine = bounded(lambda: CachedEngine(self.runner, config=self._config(), store=store),
                                         self.timeout_s)
            if status != "ok":
                self.tally.fail("hangs" if status == "hang" else "crashes", f"engine start with a hanging Redis: "
                                f"{engine!r}"[:300])
            else:
                self.serve(engine=engine, store=store)
            store.close()
        finally:
            server.close()
            self._open()

    def _redis_engine(self):
        from cachedrag.engine import CachedEngine
        from cachedrag.store.tiered import TieredStore

        self._close()
        prefix = f"cdfaults{self.rng.getrandbits(32):08x}"
        store = TieredStore.from_config(self._store_config(redis_url=self.redis_url, redis_bytes=self.disk_budget,
                                                           redis_prefix=prefix))
        engine = CachedEngine(self.runner, config=self._config(), store=store)
        return engine, store, store.tier("redis"), prefix

    def _drop_prefix(self, client, prefix: str) -> None:
        keys = list(client.scan_iter(match=f"{prefix}:*"))
        if keys:
            client.delete(*keys)

    def _fault_redis_malformed(self) -> None:
        engine, store, tier, prefix = self._redis_engine()
        client = tier.client
        try:
            self.serve(2, engine, store, (tier,))
            damage = self.rng.choice(["used", "clock", "sizes", "lru", "used_list", "size_of"])
            if damage == "used":
                client.set(f"{prefix}:__used", self.rng.choice(["lots", "-3", "1.5"]))
            elif damage == "clock":
                client.set(f"{prefix}:__clock", self.rng.choice(["tick", "9.5", ""]))
            elif damage in ("sizes", "lru"):
                client.delete(f"{prefix}:__{damage}")
                client.set(f"{prefix}:__{damage}", "oops")
            elif damage == "used_list":
                client.delete(f"{prefix}:__used")
                client.rpush(f"{prefix}:__used", "x")
            else:
                members = client.hkeys(f"{prefix}:__sizes")
                if members:
                    client.hset(f"{prefix}:__sizes", self.rng.choice(members), "big")
            self.serve(self.per_fault + 1, engine, store, (tier,))
        finally:
            store.close()
            self._drop_prefix(client, prefix)
            self._open()

    def _fault_redis_other_eviction(self) -> None:
        from cachedrag.store.redis_tier import RedisTier

        engine, store, tier, prefix = self._redis_engine()
        other = RedisTier(self.redis_url, self.disk_budget, namespace=self.namespace, prefix=prefix)
        stop = threading.Event()

        def evict():
            while not stop.is_set():
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    keys = other.keys()
                    if keys:
                        other.remove(random.choice(keys))
                time.sleep(0.002)

        try:
            self.serve(2, engine, store, (tier,))
            t = threading.Thread(target=evict, daemon=True)
            t.start()
            self.serve(self.per_fault + 1, engine, store, (tier,))
            stop.set()
            t.join()
            if tier.stats.corrupt:
                self.tally.fail("invariant_violations", f"another process's evictions counted as corrupt "
                                f"({tier.stats.corrupt})")
        finally:
            stop.set()
            store.close()
            other.close()
            self._drop_prefix(tier.client, prefix)
            self._open()

    def finish(self) -> Tally:
        self._close()
        leftovers = our_temp_files(self.disk_dir)
        if leftovers:
            self.tally.fail("leaked_files", f"temp files at the end: {[p.name for p in leftovers]}")
        for path, before in self.foreign.items():
            if snapshot(path) != before:
                self.tally.fail("foreign_touched", f"{path} changed")
        return self.tally


def _prepared(tier, key: str, blob: bytes):
    from cachedrag.store.base import Prepared

    return Prepared(key, tier._alloc(len(blob)), blob)


def run_campaign(root: Path, runner, kinds, rounds: int, *, seed: int = 0, timeout_s: float = 20.0,
                 requests_per_fault: int = 2, redis_url: str | None = None) -> Tally:
    """Inject ``rounds`` faults drawn from ``kinds`` (each kind at least once when rounds allow)."""
    campaign = Campaign(root, runner, seed=seed, timeout_s=timeout_s, requests_per_fault=requests_per_fault,
                        redis_url=redis_url)
    rng = random.Random(seed + 2)
    plan = list(kinds) * (rounds // len(kinds)) + rng.sample(list(kinds), rounds % len(kinds))
    rng.shuffle(plan)
    try:
        for kind in plan:
            try:
                campaign.inject(kind)
            except Exception as exc:  # the injector itself failed: count it, keep going
                campaign.tally.fail("crashes", f"{kind}: {type(exc).__name__}: {exc} "
                                    f"{traceback.format_exc(limit=3)[-300:]}")
                with contextlib.suppress(Exception):
                    campaign._close()
                    campaign._open()
    finally:
        tally = campaign.finish()
    return tally


def run(args: argparse.Namespace) -> int:
    import torch

    from cachedrag.errors import ConfigError
    from cachedrag.testing import tiny_runner

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ConfigError(f"unknown fault kinds {unknown}; choose from {', '.join(KINDS)}")
    if args.rounds < 1:
        raise ConfigError("--rounds must be >= 1")
    torch.set_num_threads(1)  # tiny tensors; forked children must not inherit an OpenMP pool
    server = None
    redis_url = None
    skipped: list[str] = []
    if any(k in REDIS_KINDS for k in kinds):
        if args.no_redis:
            skipped = [k for k in kinds if k in REDIS_KINDS]
        else:
            from cachedrag.store.redis_server import RedisUnavailableError, start_redis_server

            try:
                server = start_redis_server()
                redis_url = server.url
            except RedisUnavailableError as exc:
                print(f"no redis-server ({exc}); skipping {', '.join(REDIS_KINDS)}", file=sys.stderr)
                skipped = [k for k in kinds if k in REDIS_KINDS]
    kinds = [k for k in kinds if k not in skipped]
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="cachedrag-faults-"))
    t0 = time.perf_counter()
    try:
        tally = run_campaign(work, tiny_runner(), kinds, args.rounds, seed=args.seed, timeout_s=args.timeout_s,
                             requests_per_fault=args.requests_per_fault, redis_url=redis_url)
    finally:
        if server is not None:
            server.stop()
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    results = asdict(tally)
    results.pop("current")
    results.update(seconds=round(time.perf_counter() - t0, 1), seed=args.seed, rounds=args.rounds,
                   kinds=kinds, skipped_kinds=skipped, passed=all(results[k] == 0 for k in MUST_BE_ZERO))
    print(f"{'metric':<22}{'value':>8}")
    for key in ("faults_injected", "requests_checked", *MUST_BE_ZERO):
        print(f"{key:<22}{results[key]:>8}")
    print("per kind: " + ", ".join(f"{k} {n}" for k, n in sorted(tally.per_kind.items())))
    for line in tally.failures[:10]:
        print("  " + line)
    print(f"{'passed' if results['passed'] else 'FAILED'} in {results['seconds']} s")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return 0 if results["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    """The campaign as a script: ``python tests/faults/campaign.py [--rounds N] [--json OUT]``; a bad
    argument ends with one line on stderr and exit code 2."""
    from cachedrag.errors import ConfigError

    parser = argparse.ArgumentParser(prog="tests/faults/campaign.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except ConfigError as exc:
        print(f"campaign: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
