"""``netns.network_namespace`` without root: the test that asks for one skips, or fails where
the tools are required (CI runs as root: a skip there would hide the test), and nothing is
made either way."""

from __future__ import annotations

import os

import pytest
from netns import network_namespace


@pytest.mark.parametrize(
    ("env", "outcome"),
    [
        ({}, pytest.skip.Exception),
        ({"CI": "true"}, pytest.fail.Exception),
        ({"TPUSYNC_REQUIRE_TOOLS": "1"}, pytest.fail.Exception),
    ],
    ids=["local", "CI", "REQUIRE_TOOLS"],
)
def test_a_namespace_without_root_skips_or_fails_where_tools_are_required(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], outcome: type[BaseException]
) -> None:
    for name in ("CI", "TPUSYNC_REQUIRE_TOOLS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # not root, whoever runs the tests
    with pytest.raises(outcome, match=r"needs root \(ip netns add\)"), network_namespace():
        pytest.fail("a namespace was made without root")
