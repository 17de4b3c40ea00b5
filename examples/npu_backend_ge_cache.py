"""torch.compile(backend="npu_cached") with torchair GE and ge_cache=True: the GE
compile cache lives inside our cache entry, so a warm process skips both Dynamo's
backend compile and GE's graph compile.

    python examples/npu_backend_ge_cache.py   # twice
"""
import torch

import torchair_cached_backend as tcb

try:
    import torch_npu  # noqa: F401
    import torchair
except Exception as exc:
    print(f"no NPU found (torch_npu not importable): {exc}; running with compiler='inductor' on CPU "
          "instead (ge_cache needs torchair's GE, so it is off)")
    device, options = "cpu", {"compiler": "inductor"}
else:
    config = torchair.CompilerConfig()
    config.mode = "max-autotune"  # ge_cache applies to GE graphs only
    device, options = "npu", {"compiler": "torchair", "config": config, "ge_cache": True}

options["cache_dir"] = ".npu_cache_example"
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(device).eval()
compiled = torch.compile(model, backend="npu_cached", options=options)
with torch.no_grad():
    print(compiled(torch.randn(4, 32, device=device)).shape)
s = tcb.stats()
print(f"cache hits={s.hits} misses={s.misses}")
