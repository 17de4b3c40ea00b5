"""Quickstart: a small GPT through ``npu_cached``, cold then warm, each in a fresh process.

    python examples/quickstart.py [--cache-dir DIR] [--compiler auto|inductor|eager|torchair]

1. cold:   torch.compile(model, backend="npu_cached") compiles and caches;
2. warm:   the same code in a new process is served from the cache (no compile);
3. bypass: torchair_cached_backend.load(model) in a new process replays the cached
           program: no Dynamo tracing, no guards, no compile.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc_out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(C, 2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, C))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 1000, d: int = 256, n_head: int = 4, n_layer: int = 4, max_t: int = 64) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_t, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def child(phase: str, cache_dir: str, compiler: str, out_path: str) -> None:
    torch.manual_seed(0)
    model = GPT().eval()
    idx = torch.randint(0, 1000, (2, 64))
    t0 = time.perf_counter()
    with torch.no_grad():
        if phase == "bypass":
            import torchair_cached_backend as tcb

            fn = tcb.load(model, cache_dir, compiler=compiler, fallback=False)
        else:
            fn = torch.compile(model, backend="npu_cached", options={"cache_dir": cache_dir, "compiler": compiler})
        out = fn(idx)
        first_call = time.perf_counter() - t0
        ref = model(idx)
    import torchair_cached_backend as tcb

    s = tcb.stats()
    result = {
        "phase": phase,
        "first_call_s": first_call,
        "max_abs_diff": float((out - ref).abs().max()),
        "hits": s.hits,
        "misses": s.misses,
        "bypass_loads": s.bypass_loads,
        "dynamo_imported": "torch._dynamo" in sys.modules,
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=None, help="default: a new temporary directory")
    parser.add_argument("--compiler", default="auto", choices=["auto", "inductor", "eager", "torchair"])
    parser.add_argument("--child", nargs=2, metavar=("PHASE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.cache_dir, args.compiler, args.child[1])
        return
    work = tempfile.mkdtemp(prefix="tcb-quickstart-")
    cache_dir = os.path.abspath(args.cache_dir or os.path.join(work, "cache"))
    print(f"cache dir: {cache_dir}  (compiler={args.compiler}; each phase is a fresh process)")
    rows = []
    for phase in ("cold", "warm", "bypass"):
        out = os.path.join(work, f"{phase}.json")
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TORCHINDUCTOR_VEC_ISA_OK="1")
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(work, f"inductor-{phase}")  # warm phases start empty
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, __file__, "--cache-dir", cache_dir, "--compiler", args.compiler, "--child", phase, out],
            check=True,
            env=env,
        )
        with open(out) as f:
            r = json.load(f)
        r["process_s"] = time.perf_counter() - t0
        rows.append(r)
        print(
            f"{phase:>6}: first call {r['first_call_s']:8.3f} s   process {r['process_s']:6.2f} s   "
            f"hits={r['hits']} misses={r['misses']} bypass_loads={r['bypass_loads']}   "
            f"torch._dynamo imported: {r['dynamo_imported']}   max |out - eager| = {r['max_abs_diff']:.2e}"
        )
    ok = all(r["max_abs_diff"] < 1e-3 for r in rows)
    print(f"outputs match eager: {ok}")
    print(f"speed-up of the first call, cold -> bypass: {rows[0]['first_call_s'] / rows[2]['first_call_s']:.0f}x")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
