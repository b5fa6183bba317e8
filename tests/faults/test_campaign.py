"""Every injector of the fault campaign (``campaign.py`` beside this file), a few rounds each, on the
tiny model: kill -9 of forked writers, engines and index builds at random moments; planted odd
files; crafted valid-checksum entries; bit flips and truncations; a failed rename through the
index swap's seam; a second owner of the directory; deletes on a read-only disk; a Redis that
accepts and never answers; malformed Redis accounting; another process evicting Redis values.

After each fault the campaign checks, and this test asserts: no wrong answer (token ids equal
a full recompute), no crash of the serving path, no hang (every request within a time bound),
budgets held (tiers and our bytes on disk), nothing of ours left behind, nothing not ours
touched, and the store's index consistent with its tiers."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.faults.campaign import KINDS, MUST_BE_ZERO, REDIS_KINDS, run_campaign

ROUNDS = {"kill_engine": 4, "kill_writer": 4, "kill_index_build": 4, "odd_file": 6, "crafted_shape": 4}


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in REDIS_KINDS])
def test_fault_kind_leaves_no_wrong_answer_and_nothing_behind(runner, tmp_path, kind):
    tally = run_campaign(tmp_path, runner, [kind], ROUNDS.get(kind, 3), seed=7, timeout_s=20.0)
    report = asdict(tally)
    assert tally.faults_injected == ROUNDS.get(kind, 3) and tally.requests_checked > 0
    assert {k: report[k] for k in MUST_BE_ZERO} == dict.fromkeys(MUST_BE_ZERO, 0), tally.failures


@pytest.mark.redis
@pytest.mark.parametrize("kind", REDIS_KINDS)
def test_redis_fault_kind(runner, tmp_path, redis_server, kind):
    tally = run_campaign(tmp_path, runner, [kind], 3, seed=7, timeout_s=20.0, redis_url=redis_server.url)
    report = asdict(tally)
    assert tally.faults_injected == 3 and tally.requests_checked > 0
    assert {k: report[k] for k in MUST_BE_ZERO} == dict.fromkeys(MUST_BE_ZERO, 0), tally.failures


@pytest.mark.slow
def test_mixed_campaign(runner, tmp_path, redis_server):
    """The benchmark's default mix, shorter: every kind, interleaved on one directory."""
    tally = run_campaign(tmp_path, runner, KINDS, 60, seed=11, timeout_s=20.0, redis_url=redis_server.url)
    report = asdict(tally)
    assert tally.faults_injected == 60
    assert {k: report[k] for k in MUST_BE_ZERO} == dict.fromkeys(MUST_BE_ZERO, 0), tally.failures


CAMPAIGN = Path(__file__).with_name("campaign.py")


@pytest.mark.slow  # make test's time budget; make test-slow runs it
def test_the_campaign_runs_as_a_script(tmp_path):
    out_json = tmp_path / "faults.json"
    out = subprocess.run([sys.executable, str(CAMPAIGN), "--rounds", "2", "--kinds", "odd_file,bit_flip",
                          "--json", str(out_json)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out_json.read_text())
    assert report["passed"] and report["faults_injected"] == 2 and report["kinds"] == ["odd_file", "bit_flip"]


def test_the_campaign_script_refuses_an_unknown_kind():
    out = subprocess.run([sys.executable, str(CAMPAIGN), "--kinds", "nope"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "unknown fault kinds ['nope']" in out.stderr
