"""Single-flight compilation: concurrent processes compile a graph once; the others wait and load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from conftest import REPO

CHILD = textwrap.dedent(
    """
    import json, sys, time, torch
    import torchair_cached_backend as tcb
    from torchair_cached_backend.compilers import get_compiler
    eager = get_compiler("eager")
    real_compile = eager.compile
    def slow_compile(*args, **kwargs):  # widen the race window: compiling takes 3 s
        time.sleep(3)
        return real_compile(*args, **kwargs)
    eager.compile = slow_compile
    f = torch.compile(lambda x: x.cos() * 5, backend="npu_cached", options={"cache_dir": sys.argv[1], "compiler": "eager"})
    with torch.no_grad():
        y = f(torch.ones(3))
    s = tcb.stats()
    print(json.dumps({"hits": s.hits, "misses": s.misses, "ok": bool(torch.allclose(y, torch.ones(3).cos() * 5))}))
    """
)


def test_concurrent_processes_compile_once(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
        for _ in range(3)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["ok"] for r in results)
    assert sum(r["misses"] for r in results) == 1, results
    assert sum(r["hits"] for r in results) == 2, results
    assert len(os.listdir(tmp_path / "graphs")) == 1
