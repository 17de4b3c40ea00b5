"""Multi-rank cache_compile: each tensor-parallel rank caches its own graph under
``.../world{N}global_rank{r}_tp_rank{t}/``.

    torchrun --nproc_per_node=2 examples/npu_torchrun_tp.py   # twice; the second run hits
"""
import os

import torch
import torch.distributed as dist

import torchair_cached_backend as tcb

try:
    import torch_npu  # noqa: F401
    import torchair

    device_type, backend, compiler, config = "npu", "hccl", "torchair", torchair.CompilerConfig()
except Exception as exc:
    print(f"no NPU found (torch_npu not importable): {exc}; running with gloo and compiler='inductor' on CPU instead")
    device_type, backend, compiler, config = "cpu", "gloo", "inductor", None

rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
local_rank = int(os.environ.get("LOCAL_RANK", 0))
if world > 1:
    dist.init_process_group(backend)
device = torch.device(device_type, local_rank) if device_type == "npu" else torch.device("cpu")
if device_type == "npu":
    torch.npu.set_device(device)


class ShardedMLP(torch.nn.Module):
    """Column shard of a 2-layer MLP; the partial sums are all-reduced across ranks."""

    def __init__(self, hidden=64, tp=world):
        super().__init__()
        self.up = torch.nn.Linear(hidden, hidden * 2 // tp)
        self.down = torch.nn.Linear(hidden * 2 // tp, hidden, bias=False)
        self.cached = tcb.cache_compile(self.prompt, config=config, compiler=compiler,
                                        cache_dir=".npu_cache_example", tp_rank=rank)

    def forward(self, x):
        y = self.cached(x)
        if world > 1:
            dist.all_reduce(y)
        return y

    def prompt(self, x):
        return self.down(torch.relu(self.up(x)))


torch.manual_seed(rank)
model = ShardedMLP().to(device).eval()
with torch.no_grad():
    out = model(torch.randn(4, 64, device=device))
s = tcb.stats()
print(f"rank {rank}/{world}: out {tuple(out.shape)} hits={s.hits} misses={s.misses} cache={model.cached.cache_path}")
if world > 1:
    dist.destroy_process_group()
