"""Cluster settings: the documented serve.yaml builds the app; bad settings are refused clearly."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
yaml = pytest.importorskip("yaml")

from cachedrag.cluster.cli import add_arguments, check_arguments, cluster_config  # noqa: E402
from cachedrag.cluster.deployment import ClusterConfig, app_builder  # noqa: E402
from cachedrag.errors import ConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_example_serve_yaml_builds_the_application():
    doc = yaml.safe_load((ROOT / "examples" / "serve.yaml").read_text())
    (app,) = doc["applications"]
    assert app["import_path"] == "cachedrag.cluster.deployment:app_builder"
    config = ClusterConfig.model_validate(app["args"])
    assert config.replicas == 2 and config.router == "affinity" and config.replica.redis_url.startswith("redis://")
    assert type(app_builder(app["args"])).__name__ == "Application"


def test_unknown_or_bad_settings_are_refused():
    with pytest.raises(ValueError):
        ClusterConfig.model_validate({"replicas": 0})
    with pytest.raises(ValueError):
        ClusterConfig.model_validate({"replica": {"cache_gb": 1, "typo": 3}})


def _args(*argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache-gb", type=float, default=2.0)
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_arguments():
    with pytest.raises(ConfigError, match="needs --backend ray"):
        check_arguments(_args("--replicas", "3"))
    with pytest.raises(ConfigError, match="must be >= 1"):
        check_arguments(_args("--replicas", "0", "--backend", "ray"))
    check_arguments(_args("--replicas", "3", "--backend", "ray"))
    config = cluster_config(_args("--replicas", "3", "--backend", "ray", "--router", "round_robin"), "redis://h:1/0")
    assert config.replicas == 3 and config.router == "round_robin" and config.replica.redis_url == "redis://h:1/0"
    assert config.replica.api_key is None
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--api-key")
    keyed = cluster_config(parser.parse_args(["--replicas", "2", "--backend", "ray", "--api-key", "zq-7"]), None)
    assert keyed.replica.api_key.get_secret_value() == "zq-7" and "zq-7" not in repr(keyed)  # never printed
    with pytest.raises(ConfigError, match="cache_gb"):
        cluster_config(_args("--replicas", "2", "--backend", "ray", "--cache-gb", "-1"), None)


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
    passages = cluster_config(build_parser(argv).parse_args(argv), None).replica.passages
    assert (passages.min_chars, passages.attach_separators, passages.tokenization, passages.enabled) == \
        (60, True, "parts", False)
    default = cluster_config(build_parser(["serve"]).parse_args(["serve", "--replicas", "2", "--backend", "ray"]),
                             None).replica.passages
    assert (default.min_chars, default.tokenization, default.enabled) == (200, "whole", True)
    with pytest.raises(ValueError):  # the old flat field is gone, not silently ignored
        ClusterConfig.model_validate({"replica": {"auto_chunks": False}})
