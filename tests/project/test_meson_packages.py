"""The wheel installs every subpackage: each directory of Python files under src/tpusync is in
the subpackage list of src/tpusync/meson.build (a package left out is missing from the wheel,
and only the tests that run against the installed package notice)."""

from __future__ import annotations

import re

from paths import REPO

PACKAGE = REPO / "src" / "tpusync"


def test_every_subpackage_is_installed_by_meson() -> None:
    build = (PACKAGE / "meson.build").read_text()
    listed = set(
        re.findall(r"'([a-z_/]+)'", build.split("foreach package : [", 1)[1].split("]", 1)[0])
    )
    packages = {
        p.parent.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if p.parent != PACKAGE and "__pycache__" not in p.parts and p.parent.name != "_native"
    }
    assert packages - listed == set(), "add these to the subpackage list in src/tpusync/meson.build"
