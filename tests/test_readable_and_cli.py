"""readable_cache and the torchair-cache CLI on a real cache written in a child process."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys

import pytest
from subprocess_helpers import run_python

from torchair_cached_backend import readable_cache
from torchair_cached_backend.store import Store


@pytest.fixture
def filled_cache(run, tmp_path):
    cache = str(tmp_path / "cache")
    run(
        f"""
        import torch
        from models import build
        model, x = build("helper")
        with torch.no_grad():
            torch.compile(model, backend="npu_cached", options={{"cache_dir": {cache!r}, "compiler": "eager"}})(x)
        emit({{}})
        """
    )
    return cache


def test_readable_cache_prints_bytecode_graph_signature_factors(filled_cache, tmp_path, capsys):
    out_file = tmp_path / "readable.txt"
    text = readable_cache(filled_cache, print_output=True, file=str(out_file))
    assert "WithHelper.forward" in text
    assert "transformed bytecode" in text and "LOAD_GLOBAL" in text and "___tcb_graph_" in text  # renamed global
    assert "def forward(self" in text  # the graph code
    assert "checked on every call" in text and "float32[4, 8]" in text  # the per-call checks: the input
    assert "checked once when the warm start loads" in text and "helper_scale" in text  # the helper's code
    assert "## versions" in text
    assert capsys.readouterr().out.strip() == text.strip()
    assert out_file.read_text() == text and stat.S_IMODE(os.stat(out_file).st_mode) == 0o600


def test_readable_cache_missing_path_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no cached program"):
        readable_cache(str(tmp_path), print_output=False)


# ---------------------------------------------------------------------------
# the torchair-cache CLI
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_cache(tmp_path_factory):
    """A torch.compile cache with two graphs of one function (float32, float64) and a
    cache_compile tree (``<root>/<model_info>/<func>``), written by a child process."""


    root = tmp_path_factory.mktemp("cli")
    compiled, tree = str(root / "compiled"), str(root / "tree")
    run_python(
        f"""
        import torch
        import torchair_cached_backend as tcb
        from models import build
        model, x = build("helper")
        with torch.no_grad():
            c = torch.compile(model, backend="npu_cached", options={{"cache_dir": {compiled!r}, "compiler": "eager"}})
            c(x)
            c.double()(x.double())
            m, x = build("mlp")
            tcb.cache_compile(m.forward, cache_dir={tree!r}, compiler="eager")(x)
        emit({{}})
        """
    )
    return compiled, tree


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchair_cached_backend", *args], capture_output=True, text=True)


def _keys(ls_stdout: str, kind: str = "graphs") -> list[str]:
    return [line.split()[1] for line in ls_stdout.splitlines() if line.strip().startswith(kind)]


def test_cli_ls_any_level_positional_or_option(cli_cache):
    compiled, tree = cli_cache
    ls = cli("ls", compiled)
    assert ls.returncode == 0, ls.stderr
    assert len(_keys(ls.stdout)) == 2 and len(_keys(ls.stdout, "programs")) == 1
    assert "KiB" in ls.stdout and "used" in ls.stdout and "s ago" in ls.stdout  # size and last use
    assert _keys(cli("--cache-dir", compiled, "ls").stdout) == _keys(ls.stdout) == _keys(cli("ls", "--cache-dir", compiled).stdout)
    # a cache_compile root lists what lives in <model_info>/<func>, whatever level is named
    top = cli("ls", tree)
    assert top.returncode == 0 and "MLP_dynamic_" in top.stdout and len(_keys(top.stdout)) == 1, top.stdout
    (info,) = os.listdir(tree)
    for level in (os.path.join(tree, info), os.path.join(tree, info, "forward"), os.path.join(tree, info, "forward", "graphs")):
        assert len(_keys(cli("ls", level).stdout)) == 1, level
    assert cli("ls", os.path.join(tree, "nope")).returncode == 2


def test_cli_ls_reports_a_truncated_manifest(cli_cache, tmp_path):
    compiled, _ = cli_cache
    copy = str(tmp_path / "copy")
    shutil.copytree(compiled, copy)
    graphs = os.path.join(copy, "graphs")
    key = sorted(os.listdir(graphs))[0]
    manifest = os.path.join(graphs, key, "manifest.json")
    data = open(manifest, "rb").read()
    open(manifest, "wb").write(data[: len(data) // 2])
    ls = cli("ls", copy)
    assert ls.returncode == 0 and "Traceback" not in ls.stderr, ls.stderr
    assert f"{key[:16]}" in ls.stdout and "BROKEN" in ls.stdout and "truncated" in ls.stdout


def test_cli_explain_takes_the_keys_ls_prints(cli_cache):
    compiled, _ = cli_cache
    a, b = _keys(cli("ls", compiled).stdout)
    assert len(a) == 16
    out = cli("explain", a, b, compiled)
    assert out.returncode == 0, out.stderr
    assert "float64" in out.stdout and "float32" in out.stdout, out.stdout
    assert cli("explain", a[:6], b[:6], "--cache-dir", compiled).stdout == out.stdout
    unknown = cli("explain", a, "ffffffffffffffff", compiled)
    assert unknown.returncode == 2 and "no graphs entry with a key starting 'ffffffffffffffff'" in unknown.stderr


def test_cli_explain_ambiguous_prefix(tmp_path):
    store = Store(str(tmp_path), "graphs")
    for key in ("abc1" + "0" * 60, "abc2" + "0" * 60, "fff" + "0" * 61):
        store.save(key, {"f": b"x"}, {"factors": {"k": key[:4]}})
    out = cli("explain", "abc", "fff", str(tmp_path))
    assert out.returncode == 2 and "ambiguous" in out.stderr and "abc1" in out.stderr and "abc2" in out.stderr


def test_cli_validate_and_clear(cli_cache, tmp_path):
    compiled, _ = cli_cache
    copy = str(tmp_path / "copy")
    shutil.copytree(compiled, copy)
    assert cli("validate", copy).returncode == 0
    graphs = os.path.join(copy, "graphs")
    key = sorted(os.listdir(graphs))[0]
    blob = os.path.join(graphs, key, "files", "graph.py")
    data = bytearray(open(blob, "rb").read())
    data[-2] ^= 0x01  # same size, different bytes
    open(blob, "wb").write(bytes(data))
    bad = cli("validate", copy)
    assert bad.returncode == 1 and f"broken: graphs/{key[:16]}" in bad.stdout and "sha256" in bad.stdout
    assert os.listdir(os.path.join(copy, "quarantine"))
    assert cli("clear", copy).returncode == 0 and cli("ls", copy).stdout.strip() == "0 entries, 0 B"
    os.remove(os.path.join(copy, "CACHEDIR.TAG"))
    Store(copy, "graphs").save("k", {"f": b"x"}, {})
    os.remove(os.path.join(copy, "CACHEDIR.TAG"))
    refused = cli("clear", copy)
    assert refused.returncode == 2 and "no CACHEDIR.TAG" in refused.stderr
