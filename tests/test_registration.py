"""The backend is found by name in interpreters that never import the package."""

from __future__ import annotations

import pytest

from torchair_cached_backend.options import OptionError, parse_options


def test_entry_point_discovery_without_import(run, cache_dir):
    out = run(
        f"""
        import sys, torch
        listed = "npu_cached" in torch._dynamo.list_backends()
        before = "torchair_cached_backend" in sys.modules
        f = torch.compile(lambda x: (x * 2).sin(), backend="npu_cached",
                          options={{"cache_dir": {cache_dir!r}, "compiler": "eager"}})
        with torch.no_grad():
            y = f(torch.ones(3))
        emit({{"listed": listed, "imported_before": before, "ok": bool(torch.allclose(y, (torch.ones(3) * 2).sin())),
               "imported_after": "torchair_cached_backend" in sys.modules}})
        """
    )
    assert out["listed"] and out["ok"] and out["imported_after"]
    assert not out["imported_before"]


def test_import_is_cheap_and_registers_idempotently(run):
    out = run(
        """
        import sys
        import torchair_cached_backend as tcb
        heavy = sorted(m for m in sys.modules
                       if m.startswith(("torch._dynamo", "torch._inductor", "torchair.", "torch_npu")) or m == "torchair")
        import torch, torch._dynamo
        tcb.register(); tcb.register()          # idempotent, no duplicate-name error
        import importlib; importlib.reload(tcb)  # import again with Dynamo loaded
        from torch._dynamo.backends.registry import lookup_backend
        emit({"heavy": heavy, "found": lookup_backend("npu_cached").__module__})
        """
    )
    assert out["heavy"] == []
    assert out["found"] == "torchair_cached_backend.registry"


def test_entry_point_loads_after_package_import(run):
    # Dynamo discovers the entry point, then our import must not register a duplicate
    out = run(
        """
        import torch, torch._dynamo
        torch._dynamo.list_backends()           # discovery: name -> entry point
        import torchair_cached_backend
        from torch._dynamo.backends.registry import lookup_backend
        emit({"ok": callable(lookup_backend("npu_cached"))})
        """
    )
    assert out["ok"]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"cache_dirr": "x"}, "unknown npu_cached option"),
        ({"compiler": "tvm"}, "must be one of"),
        ({"ge_cache": "yes"}, "'ge_cache' must be True or False"),
        ({"global_rank": -1}, "non-negative int"),
        ({"config": object()}, "torchair CompilerConfig"),
        ({"custom_decompositions": [1]}, "dict {OpOverload: callable}"),
        ({"ge_cache": True, "compiler": "inductor"}, "needs the torchair compiler"),
    ],
)
def test_bad_options_are_clear_errors(options, message):
    with pytest.raises(OptionError, match=message) as info:
        parse_options(options)
    if "unknown" in message:
        assert "valid options are" in str(info.value) and "cache_dir" in str(info.value)


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCHAIR_CACHE_HOME", raising=False)
    assert parse_options({}).cache_dir == str(tmp_path / ".torchair_cache")
    monkeypatch.setenv("TORCHAIR_CACHE_HOME", str(tmp_path / "home"))
    assert parse_options({}).cache_dir == str(tmp_path / "home")


def test_bad_option_through_torch_compile(run, cache_dir):
    out = run(
        """
        import torch
        f = torch.compile(lambda x: x + 1, backend="npu_cached", options={"compiler": "nope"})
        try:
            f(torch.ones(2))
            emit({"error": None})
        except Exception as exc:
            emit({"error": str(exc)})
        """
    )
    assert "must be one of" in out["error"] and "inductor" in out["error"]
