"""``patch_torchair()`` semantics without the torchair harness: a stand-in ``torchair.inference``
module in ``sys.modules`` (the real torchair: tests/torchair/test_patch_real_torchair.py).

Nothing here compiles: routed ``cache_compile`` calls only build the lazy wrapper."""

from __future__ import annotations

import sys
import types

import pytest

import torchair_cached_backend as tcb


def _theirs_cache_compile(func, **kwargs):
    return ("torchair", func)


def _theirs_readable_cache(cache_bin, print_output=True, file=None):
    return f"torchair readable {cache_bin}"


@pytest.fixture
def fake_torchair(monkeypatch):
    """A torchair package whose ``inference`` module has the four names patch_torchair replaces,
    the public ones delegating to the private ones as torchair's do."""
    pkg = types.ModuleType("torchair")
    pkg.__path__ = []
    inference = types.ModuleType("torchair.inference")
    inference._cache_compile = _theirs_cache_compile
    inference._readable_cache = _theirs_readable_cache
    inference.cache_compile = lambda func, **kw: inference._cache_compile(func, **kw)
    inference.readable_cache = lambda cache_bin, print_output=True, file=None: inference._readable_cache(
        cache_bin, print_output=print_output, file=file
    )
    pkg.inference = inference
    monkeypatch.setitem(sys.modules, "torchair", pkg)
    monkeypatch.setitem(sys.modules, "torchair.inference", inference)
    yield inference
    tcb.unpatch_torchair()


def _fn(x):
    return x + 1


def test_routes_all_four_names_and_restores_them(fake_torchair, tmp_path):
    originals = dict(vars(fake_torchair))
    public_bound_early = fake_torchair.cache_compile
    with tcb.patch_torchair() as handle:
        assert handle.active and handle.owner
        for name in ("cache_compile", "readable_cache", "_cache_compile", "_readable_cache"):
            assert getattr(fake_torchair, name) is not originals[name], name
        cached = fake_torchair.cache_compile(_fn, cache_dir=str(tmp_path))
        assert type(cached).__name__ == "CacheCompiledFunction"
        # a public function bound before patching delegates to the private name: routed too
        assert type(public_bound_early(_fn, cache_dir=str(tmp_path))).__name__ == "CacheCompiledFunction"
        # routed calls compile with torchair unless they say otherwise, as torchair's own function
        same_as_ours = tcb.cache_compile(_fn, cache_dir=str(tmp_path), compiler="torchair")
        assert cached.cache_path == same_as_ours.cache_path
        own = fake_torchair.cache_compile(_fn, cache_dir=str(tmp_path), compiler="eager")
        assert own.cache_path == tcb.cache_compile(_fn, cache_dir=str(tmp_path), compiler="eager").cache_path
        assert own.cache_path != cached.cache_path
    assert not handle.active
    for name, value in originals.items():
        assert getattr(fake_torchair, name) is value, name
    assert fake_torchair.cache_compile(_fn) == ("torchair", _fn)


def test_default_compiler_is_configurable_and_validated(fake_torchair, tmp_path):
    with pytest.raises(tcb.OptionError, match="compiler"):
        tcb.patch_torchair(compiler="ge")
    assert fake_torchair.cache_compile(_fn) == ("torchair", _fn)  # a bad call patches nothing
    with tcb.patch_torchair(compiler="eager"):
        routed = fake_torchair.cache_compile(_fn, cache_dir=str(tmp_path))
    assert routed.cache_path == tcb.cache_compile(_fn, cache_dir=str(tmp_path), compiler="eager").cache_path


def test_nested_patch_and_explicit_unpatch(fake_torchair):
    outer = tcb.patch_torchair()
    inner = tcb.patch_torchair()
    assert outer.owner and not inner.owner and inner.active
    routed = fake_torchair.cache_compile
    with inner:
        pass  # leaving a nested handle keeps the outer patch
    assert fake_torchair.cache_compile is routed and outer.active
    tcb.unpatch_torchair()
    assert fake_torchair.cache_compile is not routed and not outer.active and not inner.active
    tcb.unpatch_torchair()  # idempotent
    outer.unpatch()


def test_readable_cache_serves_ours_and_hands_other_paths_to_torchair(fake_torchair, tmp_path):
    with tcb.patch_torchair():
        # not one of our caches (e.g. torchair's compiled_module): torchair's implementation, not a loop
        assert fake_torchair.readable_cache(str(tmp_path / "compiled_module")) == (
            f"torchair readable {tmp_path / 'compiled_module'}"
        )


def test_someone_patching_over_us_is_left_in_place(fake_torchair):
    tcb.patch_torchair()

    def theirs(func, **kw):
        return "third party"

    fake_torchair.cache_compile = theirs
    tcb.unpatch_torchair()
    assert fake_torchair.cache_compile is theirs
    assert fake_torchair._cache_compile is _theirs_cache_compile


def test_without_torchair_the_error_names_the_cause(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchair", None)  # "import torchair" raises ImportError
    with pytest.raises(ImportError, match=r"torchair cannot be imported here .*call torchair_cached_backend.cache_compile"):
        tcb.patch_torchair()


def test_an_unknown_torchair_layout_is_refused(monkeypatch):
    pkg = types.ModuleType("torchair")
    pkg.__path__ = []
    inference = types.ModuleType("torchair.inference")
    inference.cache_compile = _theirs_cache_compile  # no readable_cache
    monkeypatch.setitem(sys.modules, "torchair", pkg)
    monkeypatch.setitem(sys.modules, "torchair.inference", inference)
    with pytest.raises(ImportError, match=r"has no \['readable_cache'\]"):
        tcb.patch_torchair()
    assert inference.cache_compile is _theirs_cache_compile


def test_package_cache_compile_stays_callable_after_its_submodule_is_imported(run):
    """Regression: ``torchair_cached_backend.cache_compile`` was both a lazy attribute (the function)
    and a submodule; importing the submodule first rebound the package attribute to the module, so
    ``tcb.cache_compile(f)`` raised ``TypeError: 'module' object is not callable``. The implementation
    now lives in ``drop_in``, a name no public attribute shadows."""
    res = run(
        """
        import torchair_cached_backend as tcb
        from torchair_cached_backend.drop_in import CacheCompiledFunction
        emit({"type": type(tcb.cache_compile).__name__})
        """
    )
    assert res["type"] == "function"
