"""Cluster settings: the documented serve.yaml builds the app; bad settings are refused clearly."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
yaml = pytest.importorskip("yaml")

from cachedrag.cluster.cli import check_arguments, cluster_config  # noqa: E402
from cachedrag.cluster.deployment import ClusterConfig, app_builder  # noqa: E402
from cachedrag.errors import ConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_example_serve_yaml_builds_the_application():
    doc = yaml.safe_load((ROOT / "examples" / "serve.yaml").read_text())
    (app,) = doc["applications"]
    assert app["import_path"] == "cachedrag.cluster.deployment:app_builder"
    config = ClusterConfig.model_validate(app["args"])
    assert config.replicas == 2 and config.router == "affinity"
    assert config.replica.engine.redis_url.startswith("redis://")
    assert type(app_builder(app["args"])).__name__ == "Application"


def test_unknown_or_bad_settings_are_refused():
    with pytest.raises(ValueError):
        ClusterConfig.model_validate({"replicas": 0})
    with pytest.raises(ValueError):
        ClusterConfig.model_validate({"replica": {"engine": {"cache_gb": 1, "typo": 3}}})
    with pytest.raises(ValueError, match="engine.dtype"):  # one server's numerics: refused, not ignored
        ClusterConfig.model_validate({"replica": {"engine": {"dtype": "bfloat16"}}})


def _serve_parser() -> argparse.ArgumentParser:
    from cachedrag.cli import build_parser

    sub = next(a for a in build_parser(["serve"])._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _args(*argv):
    return _serve_parser().parse_args(list(argv))


def test_cli_arguments():
    with pytest.raises(ConfigError, match="needs --backend ray"):
        check_arguments(_args("--replicas", "3"))
    with pytest.raises(ConfigError, match="must be >= 1"):
        check_arguments(_args("--replicas", "0", "--backend", "ray"))
    check_arguments(_args("--replicas", "3", "--backend", "ray"))
    config = cluster_config(_args("--replicas", "3", "--backend", "ray", "--router", "round_robin"), "redis://h:1/0")
    assert config.replicas == 3 and config.router == "round_robin" and config.replica.engine.redis_url == "redis://h:1/0"
    assert config.replica.server.api_key is None
    keyed = cluster_config(_args("--replicas", "2", "--backend", "ray", "--api-key", "zq-7"), None)
    assert keyed.replica.server.api_key.get_secret_value() == "zq-7" and "zq-7" not in repr(keyed)  # never printed
    with pytest.raises(ConfigError, match="cache_gb"):
        cluster_config(_args("--replicas", "2", "--backend", "ray", "--cache-gb", "-1"), None)
    exact = cluster_config(_args("--replicas", "2", "--backend", "ray", "--fidelity", "exact"), None).replica
    assert exact.engine.fidelity == "exact" and exact.engine.reuse_mode == "prefix"
    assert exact.server.mode == exact.server_config.mode == "prefix"
    default = cluster_config(_args("--replicas", "2", "--backend", "ray"), None).replica
    assert default.engine.reuse_mode == "cachedrag" and default.server_config.model_name == "SmolLM2-135M-Instruct"
    with pytest.raises(ConfigError, match="runs mode prefix"):
        cluster_config(_args("--replicas", "2", "--backend", "ray", "--fidelity", "exact", "--mode", "full"), None)


def test_a_replicas_engine_runs_its_fidelity_level_and_the_flags_beside_it():
    from cachedrag.cluster.replica import ReplicaSettings, build_replica_engine
    from cachedrag.server.config import EngineSettings

    engine = EngineSettings(tiny=True, fidelity="faithful", exact={"tie_guard_decode": 0.5})
    config = build_replica_engine(ReplicaSettings(engine=engine)).config
    assert config.fidelity == "faithful" and config.mode == "cachedrag" and config.cache.exact.tie_guard == 0.25
    assert config.cache.exact.tie_guard_decode == 0.5  # the field given beside the level wins
    exact = ReplicaSettings(engine=EngineSettings(tiny=True, fidelity="exact"))
    assert build_replica_engine(exact).config.mode == "prefix" == exact.server_config.mode
    assert exact.server_config.model_name == "tiny-random"


def test_router_settings_reach_the_affinity_policy():
    from cachedrag.cluster.affinity import AffinityConfig
    from cachedrag.cluster.router import ChunkAffinityRouter

    defaults = ClusterConfig()
    assert (defaults.slack, defaults.load_factor, defaults.prefill_slack) == (
        AffinityConfig().slack, AffinityConfig().load_factor, AffinityConfig().prefill_slack)
    router = ChunkAffinityRouter.__new__(ChunkAffinityRouter)  # Serve constructs it; the state is ours
    router.initialize_state(slack=1, load_factor=1.5, prefill_slack=2, unrelated="ignored")
    assert router.policy.config == AffinityConfig(slack=1, load_factor=1.5, prefill_slack=2)


def test_passage_settings_reach_every_replica_and_the_router():
    """--passage-chars, --attach-separators, --tokenization and --no-auto-chunks configure each
    replica's prompt planner as they do one server's (they were dropped before), and the
    router fingerprints requests with the replicas' passage length."""
    from cachedrag.cli import build_parser

    argv = ["serve", "--replicas", "2", "--backend", "ray", "--passage-chars", "60", "--attach-separators",
            "--tokenization", "parts", "--no-auto-chunks"]
    passages = cluster_config(build_parser(argv).parse_args(argv), None).replica.server.passages
    assert (passages.min_chars, passages.attach_separators, passages.tokenization, passages.enabled) == \
        (60, True, "parts", False)
    default = cluster_config(build_parser(["serve"]).parse_args(["serve", "--replicas", "2", "--backend", "ray"]),
                             None).replica.server.passages
    assert (default.min_chars, default.tokenization, default.enabled) == (200, "whole", True)
    with pytest.raises(ValueError):  # the old flat field is gone, not silently ignored
        ClusterConfig.model_validate({"replica": {"auto_chunks": False}})


#: serve options the cluster command uses itself rather than putting into the replicas' config
_USED_BY_THE_COMMAND = {"host", "port", "log_level", "redis_url",
                        "disk_gb"}  # disk_gb: meaningful only with --disk-dir, which is refused
_CLUSTER_OWN = {"replicas", "backend", "router", "ray_address", "replica_cpus", "retries", "no_shared_cache"}


#: options whose range leaves no room for ``default + 3``: a valid value other than the default
_BOUNDED = {"preempt_ratio": "0.25",
            "index": str(Path(__file__).parent)}  # --index takes an existing directory (checked before the build)


def _non_default(action: argparse.Action) -> list[str]:
    flag = action.option_strings[0]
    if action.dest in _BOUNDED:
        return [flag, _BOUNDED[action.dest]]
    if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x: the one that is not the default
        return [action.option_strings[1] if action.default else flag]
    if action.nargs == 0:  # store_true
        return [flag]
    if action.choices:
        return [flag, next(c for c in action.choices if c != action.default)]
    if action.type in (int, float):
        return [flag, str((action.default or 0) + 3)]
    return [flag, "x"]


def test_every_serve_option_reaches_the_replicas_or_is_refused(monkeypatch):
    """With --replicas, each option of the single-process server either changes what every
    replica is built from or is refused with one line: none is silently ignored (before, the
    scheduler's bounds, chunked prefill, exact repeats, --threads and --graceful-s were)."""
    from cachedrag.server.cli import SINGLE_PROCESS_ONLY, run

    monkeypatch.delenv("CACHEDRAG_API_KEY", raising=False)
    base = ["--replicas", "2", "--backend", "ray"]
    default = cluster_config(_args(*base), None)
    checked = []
    for action in _serve_parser()._actions:
        if not action.option_strings or action.dest in {"help", "help_all", "config"} | _USED_BY_THE_COMMAND | _CLUSTER_OWN:
            continue
        args = _args(*base, *_non_default(action))
        if action.dest in SINGLE_PROCESS_ONLY:
            with pytest.raises(ConfigError, match=action.option_strings[0]):
                run(args)
        else:
            assert cluster_config(args, None) != default, f"{action.option_strings[0]} does not reach the replicas"
        checked.append(action.dest)
    assert {"max_delay_s", "prefill_chunk_tokens", "exact_repeats", "tie_guard", "tie_guard_decode", "threads",
            "graceful_s", "dtype", "disk_dir", "hold_waiting", "preempt_ratio", "passage_capacity"} <= set(checked)


def test_scheduler_settings_reach_the_replica_app():
    config = cluster_config(_args("--replicas", "2", "--backend", "ray", "--max-delay-s", "inf", "--order", "fifo",
                                  "--prefill-chunk-tokens", "0", "--exact-repeats", "1"), None)
    scheduler = config.replica.server.scheduler
    assert (scheduler.max_delay_s, scheduler.order, scheduler.prefill_chunk_tokens) == (None, "fifo", 0)
    from cachedrag.cluster.replica import build_replica_engine

    tiny = config.replica.engine.model_copy(update={"tiny": True})
    engine = build_replica_engine(config.replica.model_copy(update={"engine": tiny}))
    assert engine.config.cache.exact.repeats == 1
    assert engine.config.cache.exact.repeats_when == config.replica.engine.exact.repeats_when
    with pytest.raises(ValueError):  # the old flat fields are gone, not silently ignored
        ClusterConfig.model_validate({"replica": {"max_batch": 4}})
