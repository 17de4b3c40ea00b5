"""CPU stand-in for torchair's GE executor.

With only the C stubs, *running* a compiled GE graph never returns (the
generic stubs cannot produce the objects GE's graph API returns by value).
:func:`install` therefore replaces ``torchair.core._backend.TorchNpuGraph``'s
``load`` / ``compile`` / ``run`` / ``auto_tune`` with Python versions:

* ``load`` keeps the GE ``GraphDef`` proto and the options, and records them in
  :data:`LOADS` (with the op types, and whether the GE cache dir existed: as GE,
  it reads the model cached there, else writes one, into an existing cache dir
  only, never creating one; what it read is recorded too);
* ``compile`` / ``auto_tune`` do nothing;
* ``run`` returns, for every input of the ``NetOutput`` op, a zero tensor with
  that output's dtype and shape (or the caller's ``assigned_outputs`` tensor
  when one was given for that slot, as the real executor writes into it).

Unknown (``-1``) dims are resolved from the ``_meta`` attr torchair records on
each tensor desc, e.g. ``Tensor(dtype=torch.float32, shape=torch.Size([s0, 2]))``,
by binding the symbols against the runtime shapes of the ``Data`` inputs.

Numbers are placeholders (like torchair's own system-test GE stub): use this
for plumbing tests (caching, codegen, guards), never for numerics.
"""

from __future__ import annotations

import re
from typing import Any

_SHAPE_RE = re.compile(r"shape=torch\.Size\(\[(.*)\]\)")
_SYMBOL_RE = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*$")
_SYMINT_RE = re.compile(r"SymInt'?>?\((.*)\)\s*$")

_saved: dict[str, Any] | None = None


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    tail = "".join(current).strip()
    if tail:
        parts.append(tail)
    return parts


def _meta_text(desc) -> str:
    return desc.attr["_meta"].s.decode(errors="replace") if "_meta" in desc.attr else ""


def _meta_dims(desc) -> list[str] | None:
    match = _SHAPE_RE.search(_meta_text(desc))
    return _split_top_level(match.group(1)) if match else None


def _evaluate(expr: str, env: dict[str, int]) -> int:
    if expr.lstrip("-").isdigit():
        return int(expr)
    if _SYMBOL_RE.match(expr):
        if expr not in env:
            raise RuntimeError(f"executor shim: cannot resolve symbol {expr!r}; known: {env}")
        return env[expr]
    import sympy  # a torch dependency

    value = sympy.sympify(expr, locals={name: sympy.Symbol(name, integer=True) for name in env}).subs(env)
    if not value.is_number:
        raise RuntimeError(f"executor shim: cannot resolve dim {expr!r}; known symbols: {env}")
    return int(value)


def _bind_symbols(graph, inputs) -> dict[str, int]:
    import torch

    env: dict[str, int] = {}
    for op in graph.op:
        if op.type not in ("Data", "RefData") or "index" not in op.attr or not op.output_desc:
            continue
        idx = op.attr["index"].i
        if idx >= len(inputs):
            continue
        value, desc = inputs[idx], op.output_desc[0]
        dims = _meta_dims(desc)
        if dims is not None and isinstance(value, torch.Tensor):
            for dim, size in zip(dims, value.shape, strict=False):
                if _SYMBOL_RE.match(dim):
                    env.setdefault(dim, int(size))
            continue
        symint = _SYMINT_RE.search(_meta_text(desc))  # a SymInt graph input
        if symint and _SYMBOL_RE.match(symint.group(1).strip()):
            scalar = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
            if isinstance(scalar, int):
                env.setdefault(symint.group(1).strip(), scalar)
    return env


def _zero_outputs(graph, inputs, assigned_outputs) -> list:
    import torch
    from torchair.ge._ge_graph import _ge_proto_dtype_to_ge_dtype, ge_type_to_torch_type

    net_outputs = [op for op in graph.op if op.type == "NetOutput"]
    if not net_outputs:
        return []
    env = None
    outputs = []
    for slot, desc in enumerate(net_outputs[0].input_desc):
        if assigned_outputs and slot < len(assigned_outputs) and assigned_outputs[slot] is not None:
            outputs.append(assigned_outputs[slot])
            continue
        dims = list(desc.shape.dim)
        if any(d < 0 for d in dims) or (not dims and _meta_dims(desc)):
            if env is None:
                env = _bind_symbols(graph, inputs)
            dims = [_evaluate(d, env) for d in (_meta_dims(desc) or [])]
        dtype = ge_type_to_torch_type(_ge_proto_dtype_to_ge_dtype(desc.dtype))
        outputs.append(torch.zeros(dims, dtype=dtype))
    return outputs


#: one record per graph GE loaded in this process: the options torchair handed GE, the
#: graph's op types, and whether the GE compile-cache directory existed at that moment
LOADS: list[dict[str, Any]] = []
GE_CACHE_OPTION = "ge.graph_compiler_cache_dir"
#: what the shim writes into an existing GE cache dir (as GE would write its compiled model)
GE_CACHE_FILE = "tcb_shim_ge_cache.om"
#: what the shim's compiled model starts with
GE_CACHE_TEXT = "tcb shim GE compiled model "


def _shim_load(self, ge_graph, options=None):
    import os

    self._tcb_graph = ge_graph
    self._tcb_options = dict(options or {})
    cache_dir = self._tcb_options.get(GE_CACHE_OPTION)
    exists = bool(cache_dir) and os.path.isdir(cache_dir)
    read = None
    listing: list[str] = []
    if exists:  # GE reads the model it cached, else compiles and writes it (into the dir; never creates it)
        listing = sorted(os.listdir(cache_dir))
        model = os.path.join(cache_dir, GE_CACHE_FILE)
        if os.path.exists(model):
            with open(model, "rb") as f:
                read = f.read().decode(errors="replace")
        else:
            with open(model, "w") as f:
                f.write(GE_CACHE_TEXT + self._tcb_options.get("ge.graph_key", ""))
    LOADS.append(
        {
            "options": dict(self._tcb_options),
            "ops": [op.type for op in ge_graph.op] if hasattr(ge_graph, "op") else [],
            "ge_cache_dir_exists": exists,
            "ge_cache_read": read,  # the cached model's bytes GE loaded (None: it compiled and wrote one)
            "ge_cache_listing": listing,  # what the directory held when GE looked
        }
    )


def _shim_compile(self):
    return None


def _shim_auto_tune(self, example_inputs=(), stream=None):
    return None


def _shim_run(self, inputs, assigned_outputs=(), stream=None):
    graph = getattr(self, "_tcb_graph", None)
    if graph is None:
        raise RuntimeError("executor shim: run() called before load()")
    return _zero_outputs(graph, list(inputs), list(assigned_outputs or ()))


def install() -> None:
    """Patch ``TorchNpuGraph`` (idempotent). Import torchair first (bootstrap does)."""
    global _saved
    from torchair.core import _backend

    cls = _backend.TorchNpuGraph
    if _saved is None:
        _saved = {name: cls.__dict__[name] for name in ("load", "compile", "run", "auto_tune") if name in cls.__dict__}
    cls.load = _shim_load
    cls.compile = _shim_compile
    cls.run = _shim_run
    cls.auto_tune = _shim_auto_tune


def uninstall() -> None:
    global _saved
    if _saved is None:
        return
    from torchair.core import _backend

    for name, func in _saved.items():
        setattr(_backend.TorchNpuGraph, name, func)
    _saved = None


def installed() -> bool:
    return _saved is not None
