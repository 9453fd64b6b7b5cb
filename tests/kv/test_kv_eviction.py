"""The eviction order of a tier (kv/_eviction.py): the LRU policy against a plain list model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tpusync._src.kv._eviction import EvictionPolicy, LruPolicy

KEYS = st.binary(min_size=1, max_size=2)
OPS = st.lists(
    st.tuples(st.sampled_from(["touch", "remove"]), st.lists(KEYS, max_size=5)), max_size=40
)


@settings(max_examples=200, deadline=None)
@given(known=st.lists(KEYS, unique=True, max_size=6), ops=OPS)
def test_lru_policy_orders_keys_least_recently_used_first(known: list, ops: list) -> None:
    policy: EvictionPolicy = LruPolicy(known)
    model = list(known)
    for op, keys in ops:
        if op == "touch":
            policy.touched(keys)
            for key in keys:
                if key in model:
                    model.remove(key)
                model.append(key)
        else:
            policy.removed(keys)
            model = [k for k in model if k not in keys]
        assert list(policy.coldest()) == model
