"""`pip install .` (the README's first command) must ship every part of corral."""

from __future__ import annotations

import tomllib

from tests.helpers import ROOT


def test_every_package_and_the_dashboard_are_in_the_distribution() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = sorted(".".join(p.parent.relative_to(ROOT).parts)
                   for p in (ROOT / "actors").rglob("__init__.py"))
    assert sorted(project["packages"]) == found  # a subpackage left out breaks the install
    assert "ui.html" in project["package-data"]["actors.http"]
