"""cache_compile with the torchair compiler: the first run compiles and caches,
later runs (new processes) load the cached GE graph without recompiling.

    python examples/npu_cache_compile.py   # twice; the second run is a cache hit
"""
import torch

import torchair_cached_backend as tcb

try:
    import torch_npu  # noqa: F401
    import torchair

    DEVICE, COMPILER, CONFIG = "npu", "torchair", torchair.CompilerConfig()  # max-autotune (GE)
except Exception as exc:  # no Ascend stack here
    print(f"no NPU found (torch_npu not importable): {exc}; running with compiler='inductor' on CPU instead")
    DEVICE, COMPILER, CONFIG = "cpu", "inductor", None


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.cached_prompt = tcb.cache_compile(self.prompt, config=CONFIG, compiler=COMPILER, cache_dir=".npu_cache_example")

    def forward(self, x):
        return self.cached_prompt(x)

    def prompt(self, x):
        return torch.relu(self.linear(x)) + x


model = Model().to(DEVICE).eval()
with torch.no_grad():
    for batch in (2, 4):  # dynamic=True: one graph serves both batch sizes
        print(batch, model(torch.randn(batch, 16, device=DEVICE)).shape)
s = tcb.stats()
print(f"cache hits={s.hits} misses={s.misses} (cache at {model.cached_prompt.cache_path})")
