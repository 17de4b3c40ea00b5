"""benchmarks/warm_floor.py's own logic (no child processes): the import timer charges each
module its own time only, and the fit recovers a per-module and a per-KB cost."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import warm_floor  # noqa: E402


def test_the_fit_recovers_a_cost_per_module_and_per_kb():
    rows = [{"pyc_bytes": kb * 1024, "find_us": 30.0, "load_us": 70.0 + 8.0 * kb} for kb in (1, 5, 20, 40)]
    fixed, per_kb = warm_floor._fit(rows)
    assert fixed == pytest.approx(100.0)
    assert per_kb == pytest.approx(8.0)


def test_a_nested_import_is_charged_to_the_nested_module_only(tmp_path, monkeypatch):
    pkg = tmp_path / "floorpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "parent.py").write_text("from . import child\n")
    (pkg / "child.py").write_text("import time\ntime.sleep(0.05)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(warm_floor, "PACKAGE", "floorpkg")
    timer = warm_floor._ModuleTimer()
    sys.meta_path.insert(0, timer)
    try:
        import floorpkg.parent  # noqa: F401
    finally:
        sys.meta_path.remove(timer)
        for name in [n for n in sys.modules if n.startswith("floorpkg")]:
            del sys.modules[name]
    got = {r["module"]: r["load_us"] for r in timer.rows}
    assert set(got) == {"floorpkg", "floorpkg.parent", "floorpkg.child"}
    assert got["floorpkg.child"] >= 50_000
    assert got["floorpkg.parent"] < 25_000  # the child's 50 ms are not the parent's


def test_the_summary_splits_the_own_cost():
    warm = [{"modules": [{"module": "m", "pyc_bytes": 2048, "find_us": 50.0, "load_us": 950.0}], "guards_s": 0.002,
             "load_checks": 100, "first_call_s": 0.010, "call_s": 0.004, "import_s": 0.001, "load_s": 0.005}]
    eager = [{"first_call_s": 0.005}]
    s = warm_floor.summarize(warm, eager)
    assert s["imports_ms"] == pytest.approx(1.0)
    assert s["guards_ms"] == pytest.approx(2.0)
    assert s["us_per_check"] == pytest.approx(20.0)
    assert s["own_cost_ms"] == pytest.approx(5.0)
    assert s["rest_ms"] == pytest.approx(5.0 - 1.0 - 2.0 - (4.0 - 5.0))


def test_the_summary_reports_the_own_cost_without_checks_and_renders_it():
    warm = [{"modules": [{"module": "m", "pyc_bytes": 2048, "find_us": 50.0, "load_us": 950.0}], "guards_s": 0.002,
             "load_checks": 100, "first_call_s": 0.010, "call_s": 0.004, "import_s": 0.001, "load_s": 0.005}]
    eager = [{"first_call_s": 0.005}]
    top = [{"first_call_s": 0.009, "preloaded": True}]
    unguarded = [{"first_call_s": 0.006}, {"first_call_s": 0.0065}, {"first_call_s": 0.007}]
    s = warm_floor.summarize(warm, eager, top, None, unguarded)
    assert s["own_cost_top_ms"] == pytest.approx(4.0)
    assert s["own_cost_top_unguarded_ms"] == pytest.approx(1.5)  # the median's
    assert warm_floor.summarize(warm, eager, top)["own_cost_top_unguarded_ms"] is None
    text = warm_floor.render({"layers": [4], "repeat": 3, "note": "", "summary": {"4": s}})
    row = next(line for line in text.splitlines() if line.startswith("| 4 |"))
    assert row.rstrip().endswith("| 1.50 |")
    assert "without checks" in text
