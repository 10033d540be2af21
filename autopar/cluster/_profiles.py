"""Cost profiles: finding, reading and checking the JSON files a `Cluster` comes from.

In: a profile name (``cost_profiles/*.json``: `profile_dirs`, `available_profiles`), a
path, a JSON dict, or a JAX device kind (`builtin_profile_for`; the measured profile of
this machine at `local_profile_path`). Out: a `Cluster`, or a ValueError naming the file,
the field and the form it should take (schema: ``cost_profiles/README.md``).
`Cluster.from_profile`, `Cluster.from_json` and `Cluster.local` call into this module.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from autopar.cluster._cluster import INFORMATIONAL_KEYS, Cluster, Link

# Where `Cluster.local` and `autopar profile` keep the measured profile of this machine.
LOCAL_PROFILE_ENV = "AUTOPAR_PROFILE"
DEFAULT_LOCAL_PROFILE = Path("~/.cache/autopar/local-profile.json")

PROFILE_DIR_NAME = "cost_profiles"

# Built-in profile used by `Cluster.local` when no measured profile was saved, chosen by a
# substring of the JAX `device_kind`; anything else gets "cpu-local".
DEFAULT_PROFILE_BY_DEVICE_KIND = {
    "A100": "dgx-a100-80g",
    "H100": "dgx-h100",
    # A DGX H200 has a DGX H100's NVLink and network, with more and faster memory.
    "H200": "dgx-h100",
    "V100": "p3.16xlarge-v100",
}
FALLBACK_LOCAL_PROFILE = "cpu-local"


def local_profile_path() -> Path:
    """Where the measured profile of this machine lives: ``$AUTOPAR_PROFILE`` or the cache."""
    return Path(os.environ.get(LOCAL_PROFILE_ENV) or DEFAULT_LOCAL_PROFILE).expanduser()


def profile_dirs() -> list[Path]:
    """Folders searched for profiles by name, first match wins.

    ``autopar/cost_profiles`` (package data, if a build installs it there), then
    ``cost_profiles`` at the root of the source checkout, which an editable install uses.
    """
    package_dir = Path(__file__).resolve().parent.parent
    candidates = [package_dir / PROFILE_DIR_NAME, package_dir.parent / PROFILE_DIR_NAME]
    return [d for d in candidates if d.is_dir()]


def available_profiles() -> list[str]:
    """Names of the built-in profiles."""
    return sorted({p.stem for d in profile_dirs() for p in d.glob("*.json")})


def local_base_profile(device_kind: str) -> Cluster:
    """The profile `Cluster.local` starts from: the measured one at `local_profile_path`
    when it was measured on `device_kind` devices, else `builtin_profile_for`."""
    path = local_profile_path()
    if path.is_file():
        measured = Cluster.from_profile(path)
        if measured.device_kind == device_kind:
            return measured
        warnings.warn(
            f"the profile at {path} was measured on {measured.device_kind!r} devices but "
            f"this process has {device_kind!r} devices; using built-in figures instead. "
            f"Run `autopar profile --out {path}` to measure these devices.",
            stacklevel=3,
        )
    elif os.environ.get(LOCAL_PROFILE_ENV):
        warnings.warn(
            f"${LOCAL_PROFILE_ENV} is {path}, which does not exist; using built-in figures. "
            f"Run `autopar profile --out {path}` to measure this machine.",
            stacklevel=3,
        )
    return builtin_profile_for(device_kind)


def builtin_profile_for(device_kind: str) -> Cluster:
    """The built-in profile for a JAX `device_kind` (`DEFAULT_PROFILE_BY_DEVICE_KIND`, by
    substring), else `FALLBACK_LOCAL_PROFILE`."""
    matches = [n for k, n in DEFAULT_PROFILE_BY_DEVICE_KIND.items() if k in device_kind]
    return Cluster.from_profile(matches[0] if matches else FALLBACK_LOCAL_PROFILE)


def _resolve_profile(name_or_path: str | os.PathLike) -> Path:
    text = os.fspath(name_or_path)
    looks_like_path = text.endswith(".json") or os.sep in text or "/" in text
    if isinstance(name_or_path, os.PathLike) or looks_like_path:
        path = Path(text).expanduser()
        if not path.is_file():
            raise ValueError(f"cost profile file {path} does not exist")
        return path
    for folder in profile_dirs():
        if (folder / f"{text}.json").is_file():
            return folder / f"{text}.json"
    raise ValueError(
        f"unknown cost profile {text!r}; available profiles: "
        f"{', '.join(available_profiles()) or '(none found)'}. A path to a profile JSON file "
        "(e.g. one written by `autopar profile --out FILE.json`) works too."
    )


def load_profile(name_or_path: str | os.PathLike) -> Cluster:
    """The `Cluster` of a profile by name (`available_profiles`) or JSON file path, at the
    profile's own shape (`Cluster.from_profile`)."""
    path = _resolve_profile(name_or_path)
    return parse_profile(_read_json(path), str(path))


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(
            f"cost profile {path} is not valid JSON ({e}); fix the file or measure a new one "
            "with `autopar profile --out FILE.json`"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"cost profile {path} must hold a JSON object, got {type(data).__name__}")
    return data


def parse_profile(data: Mapping[str, Any], source: str) -> Cluster:
    """The `Cluster` of a profile dict (`Cluster.from_json`); `source` names it in error
    messages, which name the field and its expected form."""
    fields = {f.name for f in dataclasses.fields(Cluster)}
    unknown = set(data) - fields - set(INFORMATIONAL_KEYS)
    if unknown:
        raise ValueError(
            f"cost profile {source}: unknown field(s) {sorted(unknown)}; the fields are "
            f"{sorted(fields)} plus optional {list(INFORMATIONAL_KEYS)} "
            "(schema: cost_profiles/README.md)"
        )
    read = _FieldReader(data, source)
    flops = read.field("peak_flops", dict)
    try:
        return Cluster(
            name=read.field("name", str),
            num_hosts=read.field("num_hosts", int),
            devices_per_host=read.field("devices_per_host", int),
            device_kind=read.field("device_kind", str),
            device_memory=read.number("device_memory"),
            peak_flops={k: read.number(f"peak_flops.{k}", flops[k]) for k in flops},
            matmul_efficiency=read.number("matmul_efficiency"),
            hbm_bandwidth=read.number("hbm_bandwidth"),
            intra_host=read.link("intra_host"),
            inter_host=read.link("inter_host"),
            nics_per_host=read.field("nics_per_host", int) if "nics_per_host" in data else None,
            gemm_efficiency=_read_table(read, "gemm_efficiency") if "gemm_efficiency" in data
            else None,
            overlap=read.number("overlap") if "overlap" in data else 0.0,
            fused_attention=_read_bool(data, "fused_attention"),
            dispatch_overhead=read.number("dispatch_overhead")
            if "dispatch_overhead" in data else 0.0,
            task_device_overhead=read.number("task_device_overhead")
            if "task_device_overhead" in data else 0.0,
            intra_host_by_group=_read_by_group(read, "intra_host_by_group", read.link)
            if "intra_host_by_group" in data else None,
            inplace_bandwidth=read.number("inplace_bandwidth")
            if "inplace_bandwidth" in data else None,
            combined_operand_latency=read.number("combined_operand_latency")
            if "combined_operand_latency" in data else 0.0,
            transpose_bandwidth=_read_table(read, "transpose_bandwidth")
            if "transpose_bandwidth" in data else None,
            collective_latency_by_group=_read_by_group(
                read, "collective_latency_by_group", read.number)
            if "collective_latency_by_group" in data else None,
            host_cores=read.field("host_cores", int) if "host_cores" in data else None,
            kernel_overhead=read.number("kernel_overhead") if "kernel_overhead" in data
            else 0.0,
            gemm_shapes=_read_rows(read, "gemm_shapes", 4) if "gemm_shapes" in data else None,
            collective_bandwidth_by_kind=tuple(
                (kind, read.number(f"collective_bandwidth_by_kind.{kind}", scale))
                for kind, scale in read.field("collective_bandwidth_by_kind", dict).items())
            if "collective_bandwidth_by_kind" in data else None,
            token_imbalance=read.number("token_imbalance") if "token_imbalance" in data
            else 1.0,
        )
    except ValueError as e:
        if str(e).startswith("cost profile"):
            raise
        raise ValueError(f"cost profile {source}: {e}. Schema: cost_profiles/README.md") from None


def _read_rows(read, name: str, width: int) -> tuple[tuple[float, ...], ...]:
    """A list of rows of `width` numbers (`Cluster.gemm_shapes`)."""
    rows = read.field(name, list)
    if not all(isinstance(r, list) and len(r) == width for r in rows):
        read.fail(name, f"must be a list of rows of {width} numbers")
    return tuple(tuple(read.number(f"{name}.{i}", x) for x in row)
                 for i, row in enumerate(rows))


def _read_bool(data: dict, name: str) -> bool:
    value = data.get(name, False)
    if not isinstance(value, bool):
        raise ValueError(f"field {name!r} must be true or false, got {value!r}")
    return value


def _read_table(read, name: str) -> tuple[tuple[float, float], ...]:
    rows = read.field(name, list)
    if not all(isinstance(r, list) and len(r) == 2 for r in rows):
        read.fail(name, f"must be a list of pairs ({_FIELD_HELP[name]})")
    return tuple((read.number(f"{name}.{i}", r[0]), read.number(f"{name}.{i}", r[1]))
                 for i, r in enumerate(rows))


def _read_by_group(read, name: str, read_value) -> tuple[tuple[int, Any], ...]:
    """A table keyed by group size (strings >= 2), each value read by
    ``read_value(dotted name, value)``."""
    table = read.field(name, dict)
    entries = []
    for key, value in table.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) >= 2):
            read.fail(name, f"must have group sizes >= 2 as keys ({_FIELD_HELP[name]}), got "
                            f"{key!r}")
        entries.append((int(key), read_value(f"{name}.{key}", value)))
    return tuple(entries)


_MISSING = object()


@dataclass(frozen=True)
class _FieldReader:
    """Reads typed fields of a profile dict, with errors that name the file and field."""

    data: Mapping[str, Any]
    source: str

    def field(self, name: str, kind: type | tuple[type, ...], value: Any = _MISSING) -> Any:
        """The value of field `name` (dotted for nested ones, then pass `value`)."""
        help_text = _FIELD_HELP[name.split(".")[0]]
        if value is _MISSING:
            if name not in self.data:
                self.fail(name, f"is missing; add it ({help_text})")
            value = self.data[name]
        if not isinstance(value, kind) or isinstance(value, bool):
            self.fail(name, f"must be {help_text}, got {value!r}")
        return value

    def number(self, name: str, value: Any = _MISSING) -> float:
        number = self.field(name, (int, float), value)
        if not (np.isfinite(number) and number >= 0):
            self.fail(name, f"must be a finite number >= 0, got {number!r}")
        return float(number)

    def link(self, name: str, value: Any = _MISSING) -> Link:
        link = self.field(name, dict, value)
        for key in ("bandwidth", "latency"):
            if key not in link:
                help_text = _FIELD_HELP[name.split(".")[0]]
                self.fail(f"{name}.{key}", f"is missing; add it ({help_text})")
        bandwidth = self.number(f"{name}.bandwidth", link["bandwidth"])
        if bandwidth == 0:
            self.fail(f"{name}.bandwidth", "must be > 0 bytes/s")
        return Link(bandwidth, self.number(f"{name}.latency", link["latency"]))

    def fail(self, name: str, problem: str):
        raise ValueError(
            f"cost profile {self.source}: field {name!r} {problem}. "
            "Schema: cost_profiles/README.md"
        )


_FIELD_HELP = {
    "name": "a string: the profile name",
    "num_hosts": "an integer: the default number of hosts",
    "devices_per_host": "an integer: the default number of devices per host",
    "device_kind": "a string: the JAX device_kind",
    "device_memory": "a number: bytes of memory per device",
    "peak_flops": 'an object of numbers: FLOP/s per device by dtype, e.g. {"float32": 1.95e13}',
    "matmul_efficiency": "a number: the achieved fraction of peak for large matmuls, in (0, 1]",
    "hbm_bandwidth": "a number: device memory bandwidth in bytes/s",
    "intra_host": 'an object {"bandwidth": bytes/s per device, "latency": seconds}',
    "inter_host": 'an object {"bandwidth": bytes/s per device, "latency": seconds}',
    "nics_per_host": "an integer: network ports (rails) per host",
    "overlap": "a number in [0, 1]: the fraction of a hideable collective run under compute",
    "token_imbalance": "a number >= 1: the busiest device's routed MoE tokens over the mean",
    "fused_attention": "true or false: attention runs as one fused (Flash) kernel",
    "dispatch_overhead": "a number: seconds to launch one program (one pipeline task)",
    "task_device_overhead": "a number: CPU seconds per device each task costs its device "
    "thread besides its work (CPU devices sharing cores)",
    "inplace_bandwidth": "a number: memory bandwidth in bytes/s of updates written in place",
    "combined_operand_latency": "a number in [0, 1]: the share of its latency each operand "
    "of a combined collective pays",
    "intra_host_by_group": 'an object of links by group size, e.g. {"2": {"bandwidth": '
    'bytes/s per device, "latency": seconds}, "4": {...}}',
    "gemm_efficiency": "a list of [size, fraction of peak] pairs, sizes increasing, "
    "size = (M*N*K)**(1/3) per device, fractions in (0, 1]",
    "host_cores": "an integer: CPU cores the devices of a host share (CPU devices)",
    "kernel_overhead": "a number: seconds each kernel costs besides its work (launch, gap)",
    "collective_bandwidth_by_kind": 'an object of factors by collective kind, e.g. '
    '{"all_reduce": 1.1, "all_to_all": 0.3}',
    "gemm_shapes": "a list of [M, N, K, fraction of peak] rows, every combination of the "
    "M, N and K sizes present (a full grid), fractions in (0, 1]",
    "collective_latency_by_group": 'an object of seconds by group size, e.g. {"2": 6e-05, '
    '"8": 0.000275}',
    "transpose_bandwidth": "a list of [bytes read per device, bytes/s] pairs, sizes "
    "increasing: the rate of a transposing copy",
}
