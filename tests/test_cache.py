"""The on-disk plan cache: keys, hits and misses, bad entries, the switch, atomic writes."""

import json
import logging
import os
from pathlib import Path

import pytest

from autopar.cluster import Cluster
from autopar.cluster._mesh import LogicalMesh
from autopar.intra._sharding_plan import PredictedCost, ShardingPlan
from autopar.plan import InputInfo, Plan, Stage
from autopar.search._cache import PlanCache, cache_key, default_cache_dir

CLUSTER = Cluster.from_profile("cpu-local").to_json()
OPTIONS = {"method": "auto", "memory_budget": None, "mesh_shape": (2, 4)}


def small_plan(method="shard") -> Plan:
    """A hand-written one-stage plan of one weight on a (2, 4) mesh."""
    mesh = LogicalMesh.create((2, 4))
    spec = ((), ("y",))
    sharding = ShardingPlan(
        mesh=mesh,
        var_specs=(spec,),
        node_strategies=(),
        constrained=(),
        cost=PredictedCost(1e-3, 2e-4, 0.0, 1024.0, {"all_reduce": (2, 4096.0)}),
        graph_fingerprint="0123456789abcdef",
    )
    return Plan(
        method=method,
        cluster=CLUSTER,
        stages=(Stage((0, 1), sharding),),
        inputs=(InputInfo("params/w", (8, 16), "float32", "param", spec),),
        graph_fingerprint="0123456789abcdef",
    )


@pytest.fixture
def cache(tmp_path):
    return PlanCache(tmp_path / "plans", version="1.0", enabled=True)


def test_cache_key_is_canonical_and_covers_every_input():
    key = cache_key("abc", CLUSTER, OPTIONS, "1.0")
    assert len(key) == 64 and int(key, 16) >= 0
    reordered = dict(reversed(list(OPTIONS.items())))
    assert cache_key("abc", dict(reversed(list(CLUSTER.items()))), reordered, "1.0") == key
    assert cache_key("abd", CLUSTER, OPTIONS, "1.0") != key
    assert cache_key("abc", {**CLUSTER, "num_hosts": 2}, OPTIONS, "1.0") != key
    assert cache_key("abc", CLUSTER, {**OPTIONS, "method": "data"}, "1.0") != key
    assert cache_key("abc", CLUSTER, OPTIONS, "1.1") != key


def test_miss_then_hit(cache):
    key = cache_key("abc", CLUSTER, OPTIONS, cache.version)
    assert cache.get(key) is None
    plan = small_plan()
    cache.put(key, plan)
    assert cache.path(key).is_file()
    found = cache.get(key)
    assert found is not None and found.to_json() == plan.to_json()
    assert cache.get(cache_key("other", CLUSTER, OPTIONS, cache.version)) is None


@pytest.mark.parametrize(
    "content",
    ["{not json", json.dumps([1, 2]), json.dumps({"plan": {"format_version": 1}}), ""],
    ids=["bad-json", "not-an-entry", "bad-plan", "empty"],
)
def test_a_corrupt_entry_is_logged_deleted_and_replaced(cache, caplog, content):
    key = cache_key("abc", CLUSTER, OPTIONS, cache.version)
    cache.directory.mkdir(parents=True)
    cache.path(key).write_text(content)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        assert cache.get(key) is None
    assert "unusable" in caplog.text and "deleting it" in caplog.text
    assert not cache.path(key).exists()
    cache.put(key, small_plan())
    assert cache.get(key).method == "shard"


def test_a_stale_entry_from_another_version_is_dropped(tmp_path, caplog):
    key = cache_key("abc", CLUSTER, OPTIONS, "1.0")
    PlanCache(tmp_path, version="1.0", enabled=True).put(key, small_plan())
    newer = PlanCache(tmp_path, version="2.0", enabled=True)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        assert newer.get(key) is None
    assert "stale (written by autopar 1.0, this is 2.0)" in caplog.text
    assert not newer.path(key).exists()


def test_an_entry_of_an_older_plan_format_is_dropped(cache):
    key = cache_key("abc", CLUSTER, OPTIONS, cache.version)
    cache.put(key, small_plan())
    entry = json.loads(cache.path(key).read_text())
    entry["plan"]["format_version"] = 0
    cache.path(key).write_text(json.dumps(entry))
    assert cache.get(key) is None
    assert not cache.path(key).exists()


def test_disabled_by_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_PLAN_CACHE", "0")
    cache = PlanCache(tmp_path, version="1.0")
    assert not cache.enabled
    key = cache_key("abc", CLUSTER, OPTIONS, "1.0")
    cache.put(key, small_plan())
    assert list(tmp_path.iterdir()) == []
    PlanCache(tmp_path, version="1.0", enabled=True).put(key, small_plan())
    assert cache.get(key) is None, "a disabled cache never hits"
    monkeypatch.setenv("AUTOPAR_PLAN_CACHE", "1")
    assert PlanCache(tmp_path, version="1.0").get(key) is not None


def test_default_directory_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert default_cache_dir() == tmp_path / "elsewhere"
    assert PlanCache(version="1.0").directory == tmp_path / "elsewhere"
    monkeypatch.delenv("AUTOPAR_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "autopar" / "plans"


def test_the_default_version_is_the_package_version(tmp_path):
    from autopar import __version__

    assert PlanCache(tmp_path).version == __version__


def test_writes_are_atomic(cache, monkeypatch, caplog):
    key = cache_key("abc", CLUSTER, OPTIONS, cache.version)
    cache.put(key, small_plan("shard"))
    assert [p.name for p in cache.directory.iterdir()] == [f"{key}.json"], "no temp files left"

    def failing_replace(src, dst):
        assert os.path.dirname(src) == os.path.dirname(dst), "temp file in the same folder"
        assert json.loads(open(src).read())["plan"]["method"] == "data", "written in full"
        raise OSError("disk full")

    monkeypatch.setattr("autopar.search._cache.os.replace", failing_replace)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        cache.put(key, small_plan("data"))  # logged, not raised
    assert "could not write" in caplog.text
    assert [p.name for p in cache.directory.iterdir()] == [f"{key}.json"], "temp file removed"
    assert cache.get(key).method == "shard", "the old entry is intact"


def test_keys_must_be_hex_digests(cache):
    with pytest.raises(ValueError, match="not a hex digest"):
        cache.path("../../etc/passwd")
