"""readable_cache and the torchair-cache CLI on a real cache written in a child process."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from torchair_cached_backend import readable_cache


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
    assert "transformed bytecode" in text and "LOAD_GLOBAL" in text and "__compiled_fn" in text
    assert "def forward(self" in text  # the graph code
    assert '"dtype": "torch.float32"' in text and '"dims": [4, 8]' in text  # input signature
    assert "key factors" in text and "helper_scale" in text  # traced sources
    assert capsys.readouterr().out.strip() == text.strip()
    assert out_file.read_text() == text and stat.S_IMODE(os.stat(out_file).st_mode) == 0o600


def test_readable_cache_missing_path_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no cached program"):
        readable_cache(str(tmp_path), print_output=False)


def test_cli_ls_validate_clear(filled_cache):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "torchair_cached_backend", "--cache-dir", filled_cache, *args],
                              capture_output=True, text=True)

    ls = cli("ls")
    assert ls.returncode == 0 and "graphs" in ls.stdout and "programs" in ls.stdout
    assert cli("validate").returncode == 0
    graphs = os.path.join(filled_cache, "graphs")
    key = os.listdir(graphs)[0]
    with open(os.path.join(graphs, key, "files", "graph.py"), "ab") as f:
        f.write(b"# tampered\n")
    bad = cli("validate")
    assert bad.returncode == 1 and "broken: graphs/" in bad.stdout
    assert cli("clear").returncode == 0 and cli("ls").stdout.strip() == ""
