"""InductorCompiler artifacts reload in a fresh process without compiling C++.

Each case compiles a small model through a real ``torch.compile`` whose backend
calls ``InductorCompiler().compile``, stores the artifact and reference data in
a directory, then one fresh subprocess (with an empty ``TORCHINDUCTOR_CACHE_DIR``)
loads every artifact, checks outputs against the eager graph and reports which
torch modules were imported and whether the Inductor cache dir stayed empty.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from torchair_cached_backend.compilers.base import Artifact, CompileResult
from torchair_cached_backend.compilers.inductor import InductorCompiler, Uncacheable, reference_of, rewrite_wrapper
from torchair_cached_backend.options import parse_options

REPO = Path(__file__).resolve().parents[1]


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    # the hint, not int(x): int() would guard and specialize the dynamic size
    return x.node.hint if isinstance(x, torch.SymInt) else x


def _alt_inputs(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> list[Any] | None:
    """Inputs with every dynamic size grown by 2 (None if the graph is static or a
    size is not a plain symbol), to prove the artifact is reused across shapes."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sizes: dict[Any, int] = {}
    alt: list[Any] = []
    for node, x in zip(placeholders, example_inputs, strict=True):
        if isinstance(x, torch.SymInt):
            alt.append(sizes.setdefault(x.node.expr, x.node.hint + 2))
            continue
        fake = node.meta.get("example_value")
        if not isinstance(x, torch.Tensor) or fake is None:
            alt.append(_clone(x))
            continue
        shape = []
        for d in fake.shape:
            expr = d.node.expr if isinstance(d, torch.SymInt) else None
            if expr is not None and expr.is_Symbol:
                shape.append(sizes.setdefault(expr, d.node.hint + 2))
            elif expr is not None and not expr.is_number:
                return None
            else:
                shape.append(int(d))
        alt.append(_clone(x) if list(x.shape) == shape else torch.randn(shape, dtype=x.dtype))
    return alt if sizes else None


def compile_case(
    fn: Callable[..., Any], args: tuple[Any, ...], out_dir: Path, *, dynamic: bool = False, autocast: bool = False
) -> CompileResult:
    """Compile ``fn`` through Dynamo with a backend wrapping InductorCompiler and
    save its single graph's artifact plus inputs and eager reference outputs."""
    opts = parse_options({"compiler": "inductor", "cache_dir": str(out_dir / "store")})
    results: list[tuple[Any, ...]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        inputs = [_clone(x) for x in example_inputs]
        ref_in = [_clone(x) for x in example_inputs]
        alt = _alt_inputs(gm, example_inputs)
        with torch.no_grad():
            ref_out = [_clone(o) for o in gm(*ref_in)]
            alt_out = None if alt is None else [_clone(o) for o in gm(*[_clone(a) for a in alt])]
        res = InductorCompiler().compile(gm, example_inputs, opts)
        results.append((res, inputs, ref_out, ref_in, alt, alt_out))
        return res.fn

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=True)
    eager_args = [_clone(a) for a in args]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        expected = fn(*eager_args)
        got = compiled(*args)
    tol = 2e-2 if autocast else 1e-4
    for e, g in zip(_as_list(expected), _as_list(got), strict=True):
        torch.testing.assert_close(g, e, rtol=tol, atol=tol)
    assert len(results) == 1
    res, inputs, ref_out, ref_in, alt, alt_out = results[0]
    if res.artifact is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, blob in res.artifact.files.items():
            (out_dir / name).write_bytes(blob)
        (out_dir / "meta.json").write_text(json.dumps(res.artifact.meta))
        io = {"inputs": inputs, "ref_out": ref_out, "ref_in": ref_in, "alt": alt, "alt_out": alt_out}
        torch.save(io, out_dir / "io.pt")
    return res


def _as_list(x: Any) -> list[Any]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


_LOADER = textwrap.dedent(
    r"""
    import json, os, sys, time
    import torch
    from torchair_cached_backend.compilers.base import Artifact
    from torchair_cached_backend.compilers.inductor import InductorCompiler
    from torchair_cached_backend.options import parse_options

    opts = parse_options({"compiler": "inductor"})
    report = {}
    for case in json.loads(sys.argv[1]):
        d = case["dir"]
        meta = json.load(open(os.path.join(d, "meta.json")))
        io = torch.load(os.path.join(d, "io.pt"))
        # always from bytes in memory: the loader runs only verified bytes, never files by path
        files = {n: open(os.path.join(d, n), "rb").read() for n in os.listdir(d)}
        art = Artifact(files=files, meta=meta, root=None if case.get("in_memory") else d)
        t0 = time.perf_counter()
        fn = InductorCompiler().load(art, opts)
        inputs = io["inputs"]
        out = fn(*inputs)
        dt = time.perf_counter() - t0
        ok = len(out) == len(io["ref_out"])
        for o, r in zip(out, io["ref_out"]):
            tol = 2e-2 if r.dtype == torch.bfloat16 else 1e-4
            ok = ok and o.dtype == r.dtype and o.shape == r.shape and torch.allclose(o, r, rtol=tol, atol=tol)
        for i, r in zip(inputs, io["ref_in"]):
            if isinstance(r, torch.Tensor):
                ok = ok and torch.equal(i, r) and i.stride() == r.stride()
        if io["alt"] is not None:  # dynamic graph: same artifact, other sizes
            alt_out = fn(*io["alt"])
            ok = ok and all(
                o.shape == r.shape and torch.allclose(o, r, rtol=1e-4, atol=1e-4)
                for o, r in zip(alt_out, io["alt_out"])
            )
            report.setdefault("_dynamic_checked", []).append(case["name"])
        aliases = [
            isinstance(o, torch.Tensor)
            and any(
                isinstance(i, torch.Tensor)
                and o.untyped_storage().data_ptr() == i.untyped_storage().data_ptr()
                for i in inputs
            )
            for o in out
        ]
        shares = len(out) > 1 and out[0].untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr()
        report[case["name"]] = {
            "out_shares_storage": bool(shares),
            "ok": bool(ok),
            "seconds": dt,
            "aliases": aliases,
            "inductor": "torch._inductor" in sys.modules,
            "dynamo": "torch._dynamo" in sys.modules,
        }
    cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    report["_cache_files"] = [
        os.path.join(r, f) for r, _, fs in os.walk(cache) for f in fs
    ] if os.path.isdir(cache) else []
    print("REPORT" + json.dumps(report))
    """
)


def load_in_fresh_process(cases: list[dict[str, Any]], tmp: Path) -> dict[str, Any]:
    """Run the loader in a new interpreter with an empty Inductor cache dir."""
    empty = tmp / "empty_inductor_cache"
    empty.mkdir()
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(empty), PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", _LOADER, json.dumps(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT"))
    return json.loads(line[len("REPORT") :])


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).softmax(-1)


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x)))
        return self.fc(torch.nn.functional.adaptive_avg_pool2d(y, 1).flatten(1))


class Attention(torch.nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, c))


def _matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w  # no C++ kernel at all: the wrapper only calls extern mm


def _with_constant(x: torch.Tensor) -> torch.Tensor:
    return x * torch.tensor([float(i) for i in range(64)])  # becomes an Inductor constant


def _alias_and_compute(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.t(), torch.relu(x) * 2


def _mutate_data(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x.add_(1)
    return x * y


def _alias_intermediate(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x.cos() * 3
    return y, y.view(-1)


@pytest.fixture(scope="module")
def compiled_cases(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """Compile all cases once (the expensive part) and load them in one fresh process."""
    torch.manual_seed(0)
    tmp = tmp_path_factory.mktemp("inductor_artifacts")
    specs: dict[str, tuple[Callable[..., Any], tuple[Any, ...], bool]] = {
        "extern_only": (_matmul, (torch.randn(3, 4), torch.randn(4, 5)), False),
        "constant": (_with_constant, (torch.randn(2, 64),), False),
        "mlp": (MLP().eval(), (torch.randn(4, 16),), False),
        "mlp_dynamic": (MLP().eval(), (torch.randn(5, 16),), True),
        "conv": (ConvNet().eval(), (torch.randn(2, 3, 8, 8),), False),
        "attention": (Attention().eval(), (torch.randn(2, 6, 32),), False),
        "attention_dynamic": (Attention().eval(), (torch.randn(2, 7, 32),), True),
        "mutate_data": (_mutate_data, (torch.randn(4, 4), torch.randn(4, 4)), False),
        "alias_output": (_alias_and_compute, (torch.randn(3, 5),), False),
        "alias_intermediate": (_alias_intermediate, (torch.randn(3, 5),), False),
    }
    results: dict[str, CompileResult] = {}
    with torch.no_grad():
        for name, (fn, args, dynamic) in specs.items():
            results[name] = compile_case(fn, args, tmp / name, dynamic=dynamic)
        results["mlp_autocast"] = compile_case(MLP().eval(), (torch.randn(4, 16),), tmp / "mlp_autocast", autocast=True)
    for name, res in results.items():
        assert res.artifact is not None, f"{name}: {res.reason}"
    lean = [n for n, r in results.items() if r.artifact is not None and r.artifact.meta["lean"]]
    other = [n for n in results if n not in lean]
    # lean artifacts first: the sys.modules checks are only meaningful before a
    # fallback artifact imports torch._dynamo
    cases = [{"name": n, "dir": str(tmp / n)} for n in lean + other]
    cases.append({"name": "mlp_in_memory", "dir": str(tmp / "mlp"), "in_memory": True})
    report = load_in_fresh_process(cases, tmp)
    return {n: r.artifact.meta for n, r in results.items() if r.artifact}, report, tmp


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "mlp",
        "mlp_dynamic",
        "conv",
        "attention",
        "attention_dynamic",
        "mutate_data",
        "alias_output",
        "alias_intermediate",
        "extern_only",
        "constant",
        "mlp_autocast",
    ],
)
def test_loads_and_matches_eager(compiled_cases: tuple[dict[str, Any], dict[str, Any], Path], name: str) -> None:
    metas, report, _ = compiled_cases
    assert report[name]["ok"], report[name]
    if metas[name]["lean"]:
        assert not report[name]["inductor"], "lean load imported torch._inductor"
        assert not report[name]["dynamo"], "lean load imported torch._dynamo"


@pytest.mark.slow
def test_common_graphs_are_lean(compiled_cases: tuple[dict[str, Any], dict[str, Any], Path]) -> None:
    metas, _, _ = compiled_cases
    # under no_grad AOTAutograd treats views of intermediates as fresh outputs;
    # Inductor returns them via reinterpret_tensor, so the wrapper alone is exact
    lean = (
        "mlp",
        "mlp_dynamic",
        "conv",
        "attention",
        "attention_dynamic",
        "mutate_data",
        "alias_intermediate",
        "extern_only",
        "constant",
        "mlp_autocast",
    )
    for name in lean:
        assert metas[name]["lean"], (name, metas[name]["lean_blockers"])
    assert metas["mlp"]["kernels"], "expected bundled C++ kernels"
    assert not metas["extern_only"]["kernels"] and metas["extern_only"]["externs"]
    assert metas["constant"]["constants"]
    assert metas["mutate_data"]["runtime"]["bump_version"] == [0]
    assert metas["mlp_dynamic"]["runtime"]["dynamic_dims"]
    assert metas["mlp_autocast"]["runtime"]["disable_amp"]


@pytest.mark.slow
def test_aliases_are_preserved(compiled_cases: tuple[dict[str, Any], dict[str, Any], Path]) -> None:
    metas, report, _ = compiled_cases
    assert not metas["alias_output"]["lean"] and metas["alias_output"]["aot_runtime"]
    # the view output must really alias the input, as in eager
    assert report["alias_output"]["aliases"][0] is True
    assert report["alias_intermediate"]["out_shares_storage"] is True


@pytest.mark.slow
def test_no_cpp_compile_on_load(compiled_cases: tuple[dict[str, Any], dict[str, Any], Path]) -> None:
    _, report, _ = compiled_cases
    assert report["_cache_files"] == []
    assert {"mlp_dynamic", "attention_dynamic"} <= set(report["_dynamic_checked"])
    assert report["mlp_in_memory"]["ok"]


@pytest.mark.slow
def test_training_graph_is_not_cached(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    res = compile_case(model, (torch.randn(3, 4),), tmp_path)
    assert res.artifact is None
    assert "autograd" in res.reason


def test_triton_wrapper_is_rejected() -> None:
    src = "from torch._inductor.async_compile import AsyncCompile\nasync_compile = AsyncCompile()\n"
    src += "triton_poi_0 = async_compile.triton('triton_poi_0', '''...''')\n"
    with pytest.raises(Uncacheable, match="Triton"):
        rewrite_wrapper(src)


def test_hash_factors_are_json_and_stable() -> None:
    opts = parse_options({"compiler": "inductor"})
    a = InductorCompiler().hash_factors(opts)
    assert json.loads(json.dumps(a)) == a
    assert a == InductorCompiler().hash_factors(opts)


@pytest.mark.slow
def test_import_is_light_and_factors_match_cold_process(
    compiled_cases: tuple[dict[str, Any], dict[str, Any], Path],
) -> None:
    """A warm process (no Inductor import) computes the same key factors as this
    process did after compiling, and importing our module pulls in no Inductor."""
    code = (
        "import sys, json; from torchair_cached_backend.compilers.inductor import InductorCompiler; "
        "from torchair_cached_backend.options import parse_options; "
        "f = InductorCompiler().hash_factors(parse_options({'compiler': 'inductor'})); "
        "print(json.dumps([f, 'torch._inductor' in sys.modules, 'torch._dynamo' in sys.modules]))"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    factors, inductor, dynamo = json.loads(out.stdout.strip().splitlines()[-1])
    assert not inductor and not dynamo
    assert factors == InductorCompiler().hash_factors(parse_options({"compiler": "inductor"}))


def test_reference_of_externs() -> None:
    from torch._inductor.kernel.mm import bias_addmm

    assert reference_of(torch.addmm) == "torch:addmm"
    assert reference_of(torch.ops.aten.mm.out) == "torch:ops.aten.mm.out"
    assert reference_of(bias_addmm) is None  # lives in torch._inductor: not lean


@pytest.mark.slow
def test_fallback_with_inductor_externs(compiled_cases: tuple[dict[str, Any], dict[str, Any], Path]) -> None:
    """An artifact whose extern kernels need torch._inductor still loads (in-memory files)."""
    metas, _, tmp = compiled_cases
    d = tmp / "mlp"
    meta = dict(metas["mlp"], needs_inductor=True, externs={}, lean=False)
    files = {p.name: p.read_bytes() for p in d.iterdir() if p.name not in ("io.pt", "meta.json")}
    fn = InductorCompiler().load(Artifact(files=files, meta=meta), parse_options({"compiler": "inductor"}))
    io = torch.load(d / "io.pt")
    for o, r in zip(fn(*io["inputs"]), io["ref_out"], strict=True):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)


_FACTORS_CHILD = textwrap.dedent(
    r"""
    import json, sys, torch
    from torchair_cached_backend.compilers.inductor import InductorCompiler
    from torchair_cached_backend.options import parse_options

    opts = parse_options({"compiler": "inductor"})
    factors = {"default": InductorCompiler().hash_factors(opts)}
    torch.set_num_threads(torch.get_num_threads() + 1)
    factors["more_threads"] = InductorCompiler().hash_factors(opts)
    torch.set_num_threads(torch.get_num_threads() - 1)
    import torch._inductor.config as cfg

    def my_pass(graph):
        return None

    cfg.post_grad_custom_post_pass = my_pass
    factors["custom_pass"] = InductorCompiler().hash_factors(opts)
    cfg.post_grad_custom_post_pass = None
    cfg.freezing = True
    factors["freezing"] = InductorCompiler().hash_factors(opts)
    print("FACTORS" + json.dumps(factors))
    """
)


def test_hash_factors_hold_isa_and_config_by_value() -> None:
    """The CPU's ISA and Inductor config overrides (a custom pass by its
    code, never by its address) are key factors, identical in every process."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _FACTORS_CHILD], env=env, capture_output=True, text=True, check=True)
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith("FACTORS"))
        runs.append(json.loads(line[len("FACTORS") :]))
    first, second = runs
    assert first == second  # nothing process-specific (ids, addresses)
    default = first["default"]
    assert default["cpu_isa"] and "threads" not in default and "cpu_count" not in default
    assert first["more_threads"] == default  # thread count is not keyed: loaded graphs are pinned (issue 16)
    assert default["inductor_config"] == "default"
    assert len({default["inductor_config"], first["custom_pass"]["inductor_config"], first["freezing"]["inductor_config"]}) == 3
