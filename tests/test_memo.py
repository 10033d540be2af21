"""The memo tables' owner (`autopar._memo`): every table declared, a search's tables dropped
when it ends, scopes nested, and a plan the same whatever the memos held before."""

from __future__ import annotations

import functools
import importlib
import pkgutil
import weakref

import pytest

import autopar
from autopar import _memo
from autopar.app._examples import named_model
from autopar.manual import megatron_plan


@functools.cache
def _gpt():
    return named_model("gpt-tiny", batch_size=8)


def _plan(**options):
    named = _gpt()
    return autopar.plan(named.train_step, named.abstract_state, named.abstract_batch,
                        cluster="cpu-local", cache=False, **options)


def _filled(scope="search"):
    return {name: n for name, n in _memo.sizes(scope).items() if n}


def _fingerprint(plan):
    return plan.predicted_step_time, plan.to_json()


def test_every_module_memo_is_declared():
    """Each module-level weak dict and lru_cache'd function of autopar has an owner entry,
    and every process-wide table is bounded."""
    declared = {id(m.table) for m in _memo.tables()}
    missing = []
    for info in pkgutil.walk_packages(autopar.__path__, "autopar."):
        if info.name.startswith("autopar.app.__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            memo_like = (isinstance(value, weakref.WeakKeyDictionary)
                         or (hasattr(value, "cache_info") and getattr(value, "__module__", None)
                             == info.name))
            if memo_like and id(value) not in declared:
                missing.append(f"{info.name}.{name}")
    assert not missing, f"declare these memo tables in autopar._memo: {missing}"
    for m in _memo.tables("process"):
        bounded = m.limit is not None or m.table.cache_parameters()["maxsize"] is not None
        assert bounded, m.name


def test_a_process_wide_table_must_be_bounded():
    with pytest.raises(ValueError, match="process-wide but unbounded"):
        _memo.declare({}, "test.unbounded", "nothing", scope="process")
    with pytest.raises(ValueError, match="scope must be one of"):
        _memo.declare({}, "test.bad_scope", "nothing", scope="forever")
    with pytest.raises(ValueError, match="declared twice"):
        _memo.declare({}, "intra.spec_lists", "a second table under a used name")


def test_a_search_leaves_its_tables_empty_and_scopes_nest():
    """Inside an outer scope a search fills the search tables and keeps them (the inner
    scope ends first); when the outer scope ends they are empty. A search alone leaves
    them empty too."""
    _memo.clear_all()
    with _memo.search_scope():
        _plan(method="shard", mesh_shape=(8,))
        filled = _filled()
        # (tables keyed weakly by the search's graphs emptied as the graphs were freed)
        assert {"intra.spec_lists", "intra.unique_spec_tokens",
                "intra.reshard_times"} <= set(filled), filled
        assert _memo.in_search()
    assert not _memo.in_search()
    assert not _filled(), _filled()
    _plan(method="shard", mesh_shape=(8,))
    assert not _filled(), _filled()
    assert _filled("process")  # kept across searches, bounded


def test_a_failed_search_drops_its_tables():
    with pytest.raises(ValueError), _memo.search_scope():
        _plan(method="shard", mesh_shape=(8,))
        raise ValueError("the search failed")
    assert not _filled()


def test_a_megatron_plan_drops_its_tables():
    named = _gpt()
    megatron_plan(named.train_step, named.abstract_state, named.abstract_batch,
                  cluster="cpu-local", dp=4, tp=2, pp=1)
    assert not _filled(), _filled()


def test_plans_are_the_same_with_cold_and_warm_memos():
    """A search from empty tables and one after another search filled them (kept by an
    outer scope, process-wide ones too) give the same plan and prediction."""
    options = dict(method="shard", mesh_shape=(2, 4))
    _memo.clear_all()
    cold = _fingerprint(_plan(**options))
    with _memo.search_scope():
        _plan(**options)
        warm = _fingerprint(_plan(**options))
    assert warm == cold
