"""The reference page's ``cache_compile`` example, verbatim (cache_compile.md, "Example from the page").

Shared by the torchair tests that must run it exactly as written; each appends its own glue."""

REFERENCE_EXAMPLE = """\
import torch, torch_npu, torchair
from torch._decomp import get_decompositions, register_decomposition

@register_decomposition(torch.ops.aten.add.default)
def test_add_decomp(t1, t2):
    return t1 + t2

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cached = torchair.inference.cache_compile(
            self.inner_forward,
            custom_decompositions=get_decompositions([torch.ops.aten.add.default]))

    def inner_forward(self, t1, t2):
        return torch.ops.aten.add(t1, t2)

    def forward(self, t1, t2):
        return self.cached(t1, t2)
"""

#: run right after the example: ``import torch_npu`` above is the harness's fake torch_npu, removed
#: again here because torchair turns on NPU-only fusion patterns whenever any torch_npu is imported
#: (tracing them needs NPU kernels that do not exist on CPU)
DROP_FAKE_TORCH_NPU = """
import tests.torchair_harness.fake_torch_npu as _fake
_fake.uninstall()
"""

#: helpers for the child processes: our stats and logs, Dynamo's frame count, the cache files
CHILD_GLUE = """
import glob, json, os, sys
import torchair_cached_backend as tcb
from tests.child_helpers import LOGS, frames, stats
from torchair.inference._cache_compiler import ModelCacheSaver

def torchair_compiled(*a, **k):
    raise AssertionError("torchair's own cache_compile compiled (ModelCacheSaver was called)")

def files():
    return sorted(glob.glob(os.path.join(".torchair_cache", "**", "*"), recursive=True))

def result(**kw):
    kw.update(stats=stats(), frames=frames(), logs=LOGS, files=files())
    print(json.dumps(kw, default=str))
"""
