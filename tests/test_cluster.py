"""Clusters: built-in profiles, shapes, JSON round trips, errors and the local cluster."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from autopar.cluster import Cluster, Link, available_profiles, local_profile_path
from autopar.cost import device_flops, intra_link, network_link

REPO = Path(__file__).resolve().parent.parent
BUILT_IN = ["cpu-local", "dgx-a100-80g", "dgx-h100", "p3.16xlarge-v100"]


def test_built_in_profiles_are_listed_and_load():
    assert set(BUILT_IN) <= set(available_profiles())
    for name in BUILT_IN:
        cluster = Cluster.from_profile(name)
        assert cluster.name == name
        assert cluster.num_devices >= 1
        assert device_flops(cluster, "float32") > 0


def test_vendor_figures():
    a100 = Cluster.from_profile("dgx-a100-80g")
    assert (a100.num_hosts, a100.devices_per_host) == (1, 8)
    assert a100.peak_flops["bfloat16"] == 312e12
    assert a100.device_memory == 80 * 2**30
    assert a100.hbm_bandwidth == 2.0e12
    assert a100.intra_host.bandwidth == 300e9 and a100.inter_host.bandwidth == 25e9
    h100 = Cluster.from_profile("dgx-h100")
    assert h100.peak_flops["bfloat16"] == 989e12 and h100.hbm_bandwidth == 3.35e12
    assert h100.intra_host.bandwidth == 450e9 and h100.inter_host.bandwidth == 50e9
    v100 = Cluster.from_profile("p3.16xlarge-v100")
    assert v100.peak_flops["float16"] == 125e12 and v100.device_memory == 16 * 2**30
    # 25 Gb/s per host shared by 8 GPUs.
    # one 25 Gb/s NIC per host (3.125 GB/s), shared by 8 GPUs
    assert v100.inter_host.bandwidth == pytest.approx(25e9 / 8)
    assert v100.nics_per_host == 1
    assert network_link(v100).bandwidth * 8 == pytest.approx(25e9 / 8)
    assert a100.nics_per_host == h100.nics_per_host == 8
    assert network_link(a100) == a100.inter_host


def test_shape_and_device_ids():
    cluster = Cluster.from_profile("dgx-a100-80g", num_hosts=4)
    assert cluster.num_devices == 32
    assert cluster.host_of(0) == 0 and cluster.host_of(17) == 2 and cluster.host_of(31) == 3
    assert cluster.devices_of_host(1) == tuple(range(8, 16))
    small = cluster.with_shape(2, 4)
    assert small.num_devices == 8 and small.devices_of_host(1) == (4, 5, 6, 7)
    assert small.peak_flops == cluster.peak_flops
    with pytest.raises(ValueError, match="device id 32 is not in cluster"):
        cluster.host_of(32)
    with pytest.raises(ValueError, match="host 4 is not in cluster"):
        cluster.devices_of_host(4)
    assert Cluster.from_profile("dgx-h100", devices_per_host=4).num_devices == 4


def test_flops_is_peak_times_efficiency():
    a100 = Cluster.from_profile("dgx-a100-80g")
    assert device_flops(a100, "bfloat16") == pytest.approx(312e12 * 0.7)
    assert device_flops(a100, jnp.bfloat16) == device_flops(a100, "bfloat16")
    assert (device_flops(a100, "int32") == device_flops(a100, "float32")
            == pytest.approx(156e12 * 0.7))


def test_json_round_trip_and_hash(tmp_path):
    cluster = Cluster.from_profile("p3.16xlarge-v100", num_hosts=2)
    again = Cluster.from_json(json.loads(json.dumps(cluster.to_json())))
    assert again == cluster and hash(again) == hash(cluster)
    path = tmp_path / "mine.json"
    cluster.save(path, note="a test")
    assert Cluster.from_profile(path) == cluster
    assert Cluster.from_profile(str(path)) == cluster
    assert {cluster: 1}[again] == 1


def test_intra_link_by_group_size(tmp_path):
    """`intra_host_by_group`: the nearest measured group size in log2, ties to the larger;
    without the table (or for one device) `intra_host`; saved and loaded with the profile."""
    pair, quad, eight = Link(1e9, 1e-4), Link(2e9, 3e-5), Link(3e9, 1e-5)
    base = Cluster.from_profile("cpu-local")
    assert base.intra_host_by_group is None and intra_link(base, 4) == base.intra_host
    cluster = dataclasses.replace(base, intra_host_by_group=((8, eight), (2, pair), (4, quad)))
    assert cluster.intra_host_by_group == ((2, pair), (4, quad), (8, eight))  # sorted
    assert [intra_link(cluster, n) for n in (1, 2, 3, 4, 6, 8, 16)] == [
        cluster.intra_host, pair, quad, quad, eight, eight, eight]  # 3: log2 1.58 nearer 2
    again = Cluster.from_json(json.loads(json.dumps(cluster.to_json())))
    assert again == cluster and hash(again) == hash(cluster)
    assert cluster.to_json()["intra_host_by_group"]["2"] == {"bandwidth": 1e9, "latency": 1e-4}
    with pytest.raises(ValueError, match="distinct group sizes >= 2"):
        dataclasses.replace(base, intra_host_by_group=((1, pair),))
    bad = {**cluster.to_json(), "intra_host_by_group": {"two": pair.to_json()}}
    with pytest.raises(ValueError, match="group sizes >= 2 as keys"):
        Cluster.from_json(bad)
    bad["intra_host_by_group"] = {"2": {"bandwidth": 1e9}}
    with pytest.raises(ValueError, match=r"intra_host_by_group.2.latency' is missing"):
        Cluster.from_json(bad)


def test_cluster_is_frozen_and_owns_its_data():
    flops = {"float32": 1e12}
    cluster = Cluster("t", 1, 2, "cpu", 1e9, flops, 0.5, 1e10, Link(1e9, 1e-6), Link(1e8, 1e-5))
    flops["float32"] = 5.0
    assert cluster.peak_flops["float32"] == 1e12
    with pytest.raises(AttributeError):
        cluster.num_hosts = 3


def test_invalid_cluster_values():
    link = Link(1e9, 1e-6)
    with pytest.raises(ValueError, match="matmul_efficiency must be in"):
        Cluster("t", 1, 2, "cpu", 1e9, {"float32": 1e12}, 1.5, 1e10, link, link)
    with pytest.raises(ValueError, match="peak_flops must list 'float32'"):
        Cluster("t", 1, 2, "cpu", 1e9, {"bfloat16": 1e12}, 0.5, 1e10, link, link)
    with pytest.raises(ValueError, match="num_hosts must be an integer >= 1"):
        Cluster("t", 0, 2, "cpu", 1e9, {"float32": 1e12}, 0.5, 1e10, link, link)
    with pytest.raises(ValueError, match="Link.bandwidth must be > 0"):
        Link(0, 1e-6)


def test_unknown_profile_name_lists_names():
    with pytest.raises(ValueError, match="unknown cost profile 'dgx-a200'") as info:
        Cluster.from_profile("dgx-a200")
    message = str(info.value)
    assert all(name in message for name in BUILT_IN)
    assert "path to a profile JSON file" in message
    with pytest.raises(ValueError, match="does not exist"):
        Cluster.from_profile("/nonexistent/profile.json")


def _write_profile(tmp_path, **changes):
    data = Cluster.from_profile("dgx-a100-80g").to_json()
    data.update(changes)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    return path


def test_malformed_profiles_name_file_and_field(tmp_path):
    bad_json = tmp_path / "broken.json"
    bad_json.write_text('{"name": "x",')
    with pytest.raises(ValueError, match=r"broken\.json is not valid JSON"):
        Cluster.from_profile(bad_json)
    cases = [
        ({"hbm_bandwidth": None}, r"field 'hbm_bandwidth' is missing; add it \(a number"),
        ({"hbm_bandwidth": "2 TB/s"}, r"field 'hbm_bandwidth' must be a number"),
        ({"num_hosts": 1.5}, r"field 'num_hosts' must be an integer"),
        ({"peak_flops": {"float32": "fast"}}, r"field 'peak_flops.float32' must be"),
        ({"intra_host": {"bandwidth": 1e9}}, r"field 'intra_host.latency' is missing"),
        ({"inter_host": {"bandwidth": 0, "latency": 0}}, r"'inter_host.bandwidth' must be > 0"),
        ({"matmul_efficiency": 70}, r"matmul_efficiency must be in \(0, 1\]"),
        ({"hbm_bandwith": 1e12}, r"unknown field\(s\) \['hbm_bandwith'\]"),
    ]
    for changes, message in cases:
        path = _write_profile(tmp_path, **changes)
        with pytest.raises(ValueError, match=message) as info:
            Cluster.from_profile(path)
        assert str(path) in str(info.value), str(info.value)


def test_profile_lookup_from_another_directory():
    """Profiles are found relative to the package, whatever the working directory."""
    code = (
        "import autopar.cost; from autopar.cluster import Cluster; "
        "print(Cluster.from_profile('dgx-h100', num_hosts=2).num_devices)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "16"


def test_local_cluster_defaults(monkeypatch, tmp_path, devices):
    monkeypatch.setenv("AUTOPAR_PROFILE", str(tmp_path / "missing.json"))
    with pytest.warns(UserWarning, match="does not exist; using built-in figures"):
        cluster = Cluster.local()
    default = Cluster.from_profile("cpu-local")
    assert (cluster.num_hosts, cluster.devices_per_host) == (1, len(devices))
    assert cluster.device_kind == devices[0].device_kind
    assert cluster.intra_host == default.intra_host


def test_local_cluster_uses_measured_profile(monkeypatch, tmp_path, devices):
    path = tmp_path / "local.json"
    measured = Cluster.from_profile("cpu-local").with_shape(1, 3)
    measured = Cluster.from_json({**measured.to_json(), "hbm_bandwidth": 123e9})
    measured.save(path)
    monkeypatch.setenv("AUTOPAR_PROFILE", str(path))
    assert local_profile_path() == path
    cluster = Cluster.local()
    assert cluster.hbm_bandwidth == 123e9
    assert cluster.num_devices == len(devices)  # from the real devices, not the file


def test_local_cluster_ignores_profile_of_other_devices(monkeypatch, tmp_path):
    path = tmp_path / "gpu.json"
    Cluster.from_profile("dgx-a100-80g").save(path)
    monkeypatch.setenv("AUTOPAR_PROFILE", str(path))
    with pytest.warns(UserWarning, match="measured on 'NVIDIA A100-SXM4-80GB' devices"):
        cluster = Cluster.local()
    assert cluster.hbm_bandwidth == Cluster.from_profile("cpu-local").hbm_bandwidth
