"""Preloading: the preload-depth formula, layer-wise loading (exact tensors, depth, timeouts,
damage mid-load, overlap with compute) and asynchronous prefetch."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cachedrag.store.codec import ChecksumError
from cachedrag.store.config import StoreConfig
from cachedrag.store.disk import DiskTier
from cachedrag.store.preload import LayerLoader, preload_depth
from cachedrag.store.source import LayerSource
from cachedrag.store.tiered import TieredStore
from tests.store.helpers import NS, key_of, make_entry

pytestmark = pytest.mark.timeout(120)

SIZE = make_entry(0).nbytes


@pytest.mark.parametrize(
    "layers, t_prefill, t_load, depth",
    [
        (30, 1.0, 1.0, 1),  # compute as slow as loading: one layer ahead is enough
        (30, 2.0, 1.0, 1),  # compute slower than loading
        (30, 0.0, 1.0, 30),  # no compute to hide behind: load everything first
        (30, 0.5, 1.0, 16),  # 29 * 0.5 + 1 = 15.5 -> 16
        (30, 0.9, 1.0, 4),  # 29 * 0.1 + 1 = 3.9 -> 4
        (30, 0.25, 1.0, 23),  # 29 * 0.75 + 1 = 22.75 -> 23
        (10, 1.0, 3.0, 7),  # 9 * 2/3 + 1 = 7 exactly (no float round-up to 8)
        (1, 0.1, 5.0, 1),
        (30, 1.0, 0.0, 1),  # free loads
    ],
)
def test_preload_depth_table(layers, t_prefill, t_load, depth):
    assert preload_depth(layers, t_prefill, t_load) == depth


def test_preload_depth_is_stall_free():
    """With Lp layers preloaded, every layer is loaded by the time the compute reaches it."""
    for layers in (2, 7, 30):
        for tp, tl in [(0.3, 1.0), (0.7, 1.3), (0.05, 0.2)]:
            lp = preload_depth(layers, tp, tl)
            assert all((i + 1) * tl <= lp * tl + i * tp + 1e-9 for i in range(layers))
            if lp > 1:  # and one layer fewer would stall
                assert any((i + 1) * tl > (lp - 1) * tl + i * tp + 1e-9 for i in range(layers))


def test_preload_depth_rejects_bad_input():
    with pytest.raises(ValueError):
        preload_depth(0, 1, 1)
    with pytest.raises(ValueError):
        preload_depth(3, -1, 1)


def cpu_disk_store(tmp_path, cpu_entries=1) -> TieredStore:
    return TieredStore.from_config(StoreConfig(namespace=NS, cpu_bytes=cpu_entries * SIZE, disk_dir=tmp_path,
                                               disk_bytes=1 << 20, disk_fsync=False))


@pytest.mark.parametrize("where", ["cpu", "disk"])
def test_layer_loader_returns_exact_tensors(tmp_path, where):
    store = cpu_disk_store(tmp_path)
    entry = make_entry(1, layers=6, dtype=torch.float16)
    store.put(key_of(1), entry)
    if where == "disk":
        store.put(key_of(2), make_entry(2))  # pushes 1 down to disk
    assert store.where(key_of(1)) == where
    with store.open_layers(key_of(1), "cpu", depth=2) as loader:
        assert loader.n_layers == 6 and loader.meta == entry.meta
        for l in range(6):
            k, v = loader.layer(l)
            assert k.shape == (2, 8, 4) and torch.equal(k, entry.k[l]) and torch.equal(v, entry.v[l])
        assert torch.equal(loader.extras()["token_inter"], entry.tensors["token_inter"])
        assert loader.entry().equal(entry)
        assert loader.error is None and loader.mean_layer_seconds is not None
    assert store.open_layers(key_of(99)) is None


class SlowSource(LayerSource):
    """A fake source: each layer takes ``delay`` seconds; records what was loaded."""

    def __init__(self, entry, delay: float) -> None:
        self.entry, self.delay = entry, delay
        self.tier_name, self.n_layers, self.layered, self.meta = "fake", entry.n_layers, ("k", "v"), {}
        self.kv_shape, self.kv_dtype = tuple(entry.k.shape), entry.k.dtype  # [L, H_kv, T, D]
        self.loaded: list[int] = []
        self.closed = threading.Event()

    def load_layer(self, layer: int) -> dict[str, torch.Tensor]:
        time.sleep(self.delay)
        self.loaded.append(layer)
        return {"k": self.entry.k[layer].clone(), "v": self.entry.v[layer].clone()}  # [H_kv, T, D]

    def load_extras(self) -> dict[str, torch.Tensor]:
        return {}

    def close(self) -> None:
        self.closed.set()


def test_loader_stays_depth_layers_ahead():
    source = SlowSource(make_entry(3, layers=8), delay=0.001)
    loader = LayerLoader(source, "cpu", depth=3)
    time.sleep(0.2)
    assert source.loaded == [0, 1, 2]  # preloaded Lp layers, then waits for the compute
    assert loader.ready(2) and not loader.ready(3)
    loader.layer(1)
    time.sleep(0.2)
    assert source.loaded == [0, 1, 2, 3, 4]  # up to 1 + depth
    loader.close()
    assert source.closed.wait(2)


def test_timeout_and_readiness_let_the_engine_give_up():
    source = SlowSource(make_entry(4, layers=3), delay=0.3)
    loader = LayerLoader(source, "cpu", depth=1)
    assert not loader.ready(0)
    t0 = time.perf_counter()
    assert loader.layer(0, timeout=0.01) is None  # past the break-even point: recompute instead
    assert time.perf_counter() - t0 < 0.2
    k, _ = loader.layer(0)  # or wait for it
    assert torch.equal(k, source.entry.k[0]) and loader.ready(0)
    loader.close()


def test_damage_found_mid_load_is_a_miss_with_the_reason(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, namespace=NS, fsync=False)
    entry = make_entry(5, layers=5)
    tier.put(key_of(5), entry)
    source = tier.open_source(key_of(5))
    loader = LayerLoader(source, "cpu", depth=1)
    assert loader.layer(0) is not None
    offset, _ = source._header.layer_range("k", 3)
    with open(tier.path(key_of(5)), "r+b") as f:  # damage layer 3 under the open loader
        f.seek(offset + 2)
        byte = f.read(1)
        f.seek(offset + 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert torch.equal(loader.layer(2)[0], entry.k[2])
    assert loader.layer(3) is None and loader.layer(4, timeout=1) is None
    assert isinstance(loader.error, ChecksumError)
    assert tier.stats.corrupt == 1 and not tier.contains(key_of(5))
    loader.close()


def test_loading_overlaps_compute():
    layers, t = 8, 0.03
    source = SlowSource(make_entry(6, layers=layers), delay=t)
    t0 = time.perf_counter()
    with LayerLoader(source, "cpu", depth=preload_depth(layers, t, t)) as loader:
        for l in range(layers):
            assert loader.layer(l) is not None
            time.sleep(t)  # the "prefill" of layer l
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.8 * (2 * layers * t), f"no overlap: {elapsed:.3f}s vs {2 * layers * t:.3f}s serial"


def test_prefetch_moves_entries_up_in_the_background(tmp_path):
    store = cpu_disk_store(tmp_path, cpu_entries=2)
    for i in range(4):
        store.put(key_of(i), make_entry(i))
    assert store.where(key_of(0)) == "disk"
    handle = store.prefetch([key_of(0), key_of(3), key_of(77)])
    assert handle.wait(10)
    assert handle.results() == {key_of(0): True, key_of(3): True, key_of(77): False}
    assert store.where(key_of(0)) == "cpu" and store.stats.prefetches == 3
    assert store.check_invariants() == []
    store.close()


def test_wait_prefetches_waits_for_promotions_nobody_holds_a_handle_of(tmp_path):
    store = cpu_disk_store(tmp_path, cpu_entries=2)
    for i in range(4):
        store.put(key_of(i), make_entry(i))
    gate = threading.Event()
    fetch_up = store._fetch_up
    store._prefetcher._fetch = lambda key: gate.wait(10) and fetch_up(key)
    store.prefetch([key_of(0)])  # the engine drops its handle like this
    assert not store.wait_prefetches(0.05)  # still held at the gate
    assert store.where(key_of(0)) == "disk"
    gate.set()
    assert store.wait_prefetches(10)
    assert store.where(key_of(0)) == "cpu" and store.wait_prefetches(0)  # nothing left in flight
    store.close()


@pytest.mark.redis
def test_layer_loader_from_redis(redis_server, redis_prefix):
    store = TieredStore.from_config(StoreConfig(namespace=NS, redis_url=redis_server.url, redis_bytes=1 << 20,
                                                redis_prefix=redis_prefix))
    entry = make_entry(7, layers=4, dtype=torch.bfloat16)
    store.put(key_of(7), entry)
    with store.open_layers(key_of(7), "cpu", depth=1) as loader:
        assert loader.entry(timeout=10).equal(entry)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layer_loader_to_cuda(tmp_path):
    store = cpu_disk_store(tmp_path)
    entry = make_entry(8, layers=4)
    store.put(key_of(8), entry)
    store.put(key_of(9), make_entry(9))
    for key, want in [(key_of(8), entry), (key_of(9), make_entry(9))]:
        with store.open_layers(key, "cuda", depth=2) as loader:
            for l in range(4):
                k, v = loader.layer(l)
                assert k.is_cuda and torch.equal(k.cpu(), want.k[l]) and torch.equal(v.cpu(), want.v[l])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_cpu_entries_are_copied_by_queued_copies_without_a_thread(tmp_path):
    store = TieredStore.from_config(StoreConfig(namespace=NS, cpu_bytes=64 * SIZE, pin_memory=True))
    entry = make_entry(10, layers=10)  # groups of QUEUED_GROUP layers, the last one partial
    store.put(key_of(10), entry)
    with store.open_layers(key_of(10), "cuda", depth=1) as loader:
        assert loader._thread is None and loader._queued  # queued on the copy stream
        torch.cuda.set_sync_debug_mode("error")  # handing a layer over must not wait for the copy
        try:
            layers = [loader.layer(l) for l in range(10)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for l, (k, v) in enumerate(layers):
            assert k.is_cuda and torch.equal(k.cpu(), entry.k[l]) and torch.equal(v.cpu(), entry.v[l])
