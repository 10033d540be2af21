"""An on-disk cache of plans, so that re-running a script skips the search.

A plan is stored under a key that hashes everything the search depends on: the traced
program (`graph_fingerprint`), the cluster, the planning options and the autopar version.
Each entry is one JSON file ``<key>.json`` holding the plan and the version that wrote it.

- Location: ``$AUTOPAR_CACHE_DIR``, else ``~/.cache/autopar/plans``.
- ``AUTOPAR_PLAN_CACHE=0`` turns the cache off (`get` misses, `put` does nothing).
- A corrupt, unreadable or stale entry (written by another autopar version or plan format)
  is logged, deleted and treated as a miss.
- Writes are atomic (a temporary file in the same folder, then `os.replace`), so processes
  sharing the folder never read half a file.

**Example:**

```python
cache = PlanCache()
key = cache_key(sharding.graph_fingerprint, cluster.to_json(), {"method": "auto"}, version)
plan = cache.get(key)
if plan is None:
    plan = search(...)
    cache.put(key, plan)
```
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from autopar._memo import memo
from autopar._version import __version__
from autopar.plan import Plan

log = logging.getLogger("autopar")

CACHE_DIR_ENV = "AUTOPAR_CACHE_DIR"
CACHE_SWITCH_ENV = "AUTOPAR_PLAN_CACHE"
DEFAULT_CACHE_DIR = "~/.cache/autopar/plans"
# Values of AUTOPAR_PLAN_CACHE that turn the cache off.
DISABLED_VALUES = frozenset({"0", "false", "no", "off"})


def cache_key(
    graph_fingerprint: str, cluster_json: dict, options: dict, version: str
) -> str:
    """The cache key of one search: a sha256 hex digest of a canonical JSON.

    **Arguments:**
    - `graph_fingerprint`: the traced program's fingerprint (`ShardingPlan.graph_fingerprint`).
    - `cluster_json`: `Cluster.to_json()`.
    - `options`: the planning options as a JSON-ready dict (method, budget, mesh shape...).
    - `version`: the autopar version; a new version never reuses an old plan.

    **Returns:** 64 hex digits. Equal inputs give equal keys whatever the dict order.
    """
    document = {
        "graph": graph_fingerprint,
        "cluster": cluster_json,
        "options": options,
        "version": version,
    }
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), default=_jsonable)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _jsonable(value: Any) -> Any:
    """Option values JSON has no form for: sets as sorted lists, anything else by repr."""
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    return repr(value)


def cache_enabled() -> bool:
    """False when ``AUTOPAR_PLAN_CACHE`` is ``0`` (or false, no, off)."""
    return os.environ.get(CACHE_SWITCH_ENV, "1").strip().lower() not in DISABLED_VALUES


def default_cache_dir() -> Path:
    """``$AUTOPAR_CACHE_DIR``, else ``~/.cache/autopar/plans``."""
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR).expanduser()


def _package_version() -> str:
    return __version__


@memo("search.code_version", "nothing: autopar's one source hash", maxsize=1)
def code_version() -> str:
    """autopar's version and a hash of its source, so a code change never reuses a plan."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return f"{__version__}+{digest.hexdigest()[:12]}"


class PlanCache:
    """Plans on disk, one JSON file per key.

    **Arguments:**
    - `directory`: where the entries live; default `default_cache_dir()`. Created on the
      first `put`.
    - `version`: the version stamped into entries and required on reading; default the
      installed autopar version.
    - `enabled`: default `cache_enabled()` (the ``AUTOPAR_PLAN_CACHE`` switch, read here,
      once).
    """

    def __init__(
        self,
        directory: str | os.PathLike | None = None,
        version: str | None = None,
        enabled: bool | None = None,
    ):
        self.directory = Path(directory).expanduser() if directory else default_cache_dir()
        self.version = version if version is not None else _package_version()
        self.enabled = cache_enabled() if enabled is None else enabled

    def path(self, key: str) -> Path:
        """The file of entry `key`."""
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"cache key {key!r} is not a hex digest; make keys with cache_key()")
        return self.directory / f"{key}.json"

    def get(self, key: str) -> Plan | None:
        """The plan stored under `key`, or None on a miss (or when the cache is off).

        A corrupt, unreadable or stale entry is logged at WARNING, deleted and missed.
        """
        if not self.enabled:
            return None
        path = self.path(key)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as err:
            self._discard(path, f"it cannot be read ({err})")
            return None
        try:
            entry = json.loads(text)
            problem = self._check_entry(entry, key)
            if problem is None:
                plan = Plan.from_json(entry["plan"])
        except (ValueError, KeyError, TypeError) as err:  # JSONDecodeError is a ValueError
            problem = f"it is corrupt ({type(err).__name__}: {err})"
        if problem is not None:
            self._discard(path, problem)
            return None
        log.info("plan cache hit: %s", path)
        return plan

    def put(self, key: str, plan: Plan) -> None:
        """Store `plan` under `key`, atomically; a write error is logged, never raised."""
        if not self.enabled:
            return
        path = self.path(key)
        entry = {"autopar_version": self.version, "key": key, "plan": plan.to_json(timings=True)}
        text = json.dumps(entry, sort_keys=True)
        temp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(temp, path)
            temp = None
        except OSError as err:
            log.warning("plan cache: could not write %s (%s); continuing without it", path, err)
        finally:
            if temp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temp)

    def clear(self) -> int:
        """Delete every entry; returns how many were deleted."""
        if not self.directory.is_dir():
            return 0
        removed = 0
        for entry in self.directory.glob("*.json"):
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
                removed += 1
        return removed

    def _check_entry(self, entry: Any, key: str) -> str | None:
        """Why `entry` cannot be used for `key`, or None when it can."""
        if not isinstance(entry, dict) or "plan" not in entry:
            return "it is corrupt (not a plan cache entry)"
        if entry.get("key") != key:
            return f"it is corrupt (it holds key {entry.get('key')!r})"
        written_by = entry.get("autopar_version")
        if written_by != self.version:
            return f"it is stale (written by autopar {written_by}, this is {self.version})"
        return None

    def _discard(self, path: Path, problem: str) -> None:
        log.warning("plan cache entry %s is unusable: %s; deleting it", path, problem)
        with contextlib.suppress(OSError):
            path.unlink()
