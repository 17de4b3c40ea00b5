"""Generate stand-in CANN / torch_npu shared libraries for torchair's C extensions.

The ``torchair/core/*.so`` files shipped in the torch_npu wheel are linked
against the Ascend toolkit (libge_runner.so, libascendcl.so, ... and
libtorch_npu.so).  None of those exist on a CPU box, so we build libraries
with the same sonames that define every symbol the extensions import and
that nothing else in the process provides:

* ``manual_stub.cpp`` gives real behaviour to the handful of symbols that are
  actually exercised while torchair compiles a graph (``ge::AscendString``,
  ``GEInitialize`` ...);
* the three securec string functions get tiny real implementations;
* every other function becomes "log once, return 0" (0 is ge::SUCCESS and
  ACL_SUCCESS); ``CANN_STUB_ABORT=1`` turns those into ``abort()`` which is
  handy to find out what a new code path calls; ``CANN_STUB_QUIET=1`` mutes
  the log line.

All generated code lives in libge_runner.so (at_npu/c10_npu symbols go into
libtorch_npu.so); the other sonames are empty libraries that merely have to
exist.  The caller preloads all of them with RTLD_GLOBAL (see bootstrap.py).

Usable as a script: ``python gen_stubs.py <dir containing torchair/> <out>``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
MANUAL_SOURCE = HERE / "manual_stub.cpp"

EXTENSIONS = ("_abi_compat_ge_apis", "_torchair", "_npu_graph_executor", "_npu_utils")
CANN_SONAMES = (
    "libge_runner.so",
    "libfmk_parser.so",
    "libascendcl.so",
    "libacl_op_compiler.so",
    "libacl_tdt_channel.so",
    "libascend_protobuf.so",
    "libgraph.so",
    "libhccl.so",
)
TORCH_NPU_SONAME = "libtorch_npu.so"
#: every library the bootstrap must preload, in load order
ALL_SONAMES = CANN_SONAMES + (TORCH_NPU_SONAME,)
SYSTEM_LIBS = ("libstdc++.so.6", "libc.so.6", "libm.so.6", "libgcc_s.so.1")

_PRELUDE = r"""#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void cann_stub_trace(const char *sym, int *reported) {
  if (!*reported) {
    *reported = 1;
    if (!getenv("CANN_STUB_QUIET")) fprintf(stderr, "[cann-stub] called %s\n", sym);
  }
  if (getenv("CANN_STUB_ABORT")) {
    fprintf(stderr, "[cann-stub] CANN_STUB_ABORT set, aborting in %s\n", sym);
    abort();
  }
}
"""

# securec (libc_sec) functions used by the extensions' logging macros.
_SECUREC = {
    "strcpy_s": r"""
int strcpy_s(char *dst, size_t cap, const char *src) {
  size_t n;
  if (!dst || !src) return 1;
  n = strlen(src);
  if (n + 1 > cap) return 1;
  memcpy(dst, src, n + 1);
  return 0;
}
""",
    "vsnprintf_s": r"""
int vsnprintf_s(char *dst, size_t cap, size_t count, const char *fmt, va_list ap) {
  size_t limit = (count + 1 < cap) ? count + 1 : cap;
  int r;
  if (!dst || limit == 0) return -1;
  r = vsnprintf(dst, limit, fmt, ap);
  return (r < 0 || (size_t)r >= limit) ? -1 : r;
}
""",
    "snprintf_s": r"""
int snprintf_s(char *dst, size_t cap, size_t count, const char *fmt, ...) {
  va_list ap;
  int r;
  va_start(ap, fmt);
  r = vsnprintf_s(dst, cap, count, fmt, ap);
  va_end(ap);
  return r;
}
""",
}


class StubBuildError(RuntimeError):
    pass


def _run(cmd: list[str]) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError as exc:  # tool vanished between which() and here
        raise StubBuildError(f"cannot run {cmd[0]!r}: {exc}") from exc
    if res.returncode != 0:
        raise StubBuildError(f"command failed ({res.returncode}): {' '.join(cmd)}\n{res.stderr[-4000:]}")
    return res.stdout


def dynamic_symbols(path: os.PathLike | str, *, defined: bool, table: str = "--dyn-syms") -> dict[str, str]:
    """``{name: type}`` of the defined (or undefined, non-weak) symbols of an ELF file."""
    out = _run(["readelf", "-W", table, str(path)])
    symbols: dict[str, str] = {}
    for line in out.splitlines():
        cols = line.split()
        # Num: Value Size Type Bind Vis Ndx Name
        if len(cols) < 8 or not cols[0].endswith(":"):
            continue
        sym_type, bind, ndx, name = cols[3], cols[4], cols[6], cols[7].split("@")[0]
        if not name:
            continue
        if defined:
            if ndx != "UND" and bind in ("GLOBAL", "WEAK", "UNIQUE"):
                symbols[name] = sym_type
        elif ndx == "UND" and bind != "WEAK":
            symbols[name] = sym_type
    return symbols


def _system_library(name: str) -> Path | None:
    out = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    path = Path(out)
    # gcc echoes the bare name back when it cannot find the file
    return path.resolve() if path.is_absolute() and path.exists() else None


def _provider_libraries(core_dir: Path) -> list[Path]:
    """Everything that will already be in the process when torchair is imported."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        raise StubBuildError("torch is not importable from this interpreter")
    torch_lib = Path(spec.origin).parent / "lib"
    libs = sorted(p for p in torch_lib.iterdir() if ".so" in p.name and p.is_file())
    libs += [p for p in map(_system_library, SYSTEM_LIBS) if p is not None]
    libs += [core_dir / f"{ext}.so" for ext in EXTENSIONS]
    libpython = Path(sysconfig.get_config_var("LIBDIR") or "") / (sysconfig.get_config_var("LDLIBRARY") or "")
    if libpython.is_file():
        libs.append(libpython)
    libs.append(Path(sys.executable).resolve())
    return [p for p in libs if p.is_file()]


def _c_function(index: int, symbol: str) -> str:
    return (
        f'long cann_stub_fn_{index}(void) __asm__("{symbol}");\n'
        f'long cann_stub_fn_{index}(void) {{ static int seen; cann_stub_trace("{symbol}", &seen); return 0; }}\n'
    )


def _c_object(index: int, symbol: str) -> str:
    return f'char cann_stub_obj_{index}[256] __asm__("{symbol}");\n'


def generate(torchair_parent: os.PathLike | str, out_dir: os.PathLike | str, *, log=print) -> dict:
    """Build the stub libraries into ``out_dir``; returns a small summary dict."""
    core_dir = Path(torchair_parent).resolve() / "torchair" / "core"
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    missing_ext = [e for e in EXTENSIONS if not (core_dir / f"{e}.so").is_file()]
    if missing_ext:
        raise StubBuildError(f"torchair extensions not found in {core_dir}: {missing_ext}")

    provided: set[str] = set()
    for lib in _provider_libraries(core_dir):
        provided.update(dynamic_symbols(lib, defined=True))

    manual_obj = out / "manual_stub.o"
    _run(
        [
            "g++",
            "-std=c++17",
            "-fPIC",
            "-O1",
            "-D_GLIBCXX_USE_CXX11_ABI=0",
            "-c",
            str(MANUAL_SOURCE),
            "-o",
            str(manual_obj),
        ]
    )
    manual = set(dynamic_symbols(manual_obj, defined=True, table="--syms"))

    wanted: dict[str, str] = {}
    for ext in EXTENSIONS:
        for name, sym_type in dynamic_symbols(core_dir / f"{ext}.so", defined=False).items():
            if name in provided or name in manual or name.startswith(("Py", "_Py")) or name == "__tls_get_addr":
                continue
            wanted.setdefault(name, sym_type)

    cann_src, npu_src = [_PRELUDE], [_PRELUDE]
    for index, (name, sym_type) in enumerate(sorted(wanted.items())):
        if name in _SECUREC:
            cann_src.append(_SECUREC[name])
            continue
        target = npu_src if ("c10_npu" in name or "at_npu" in name) else cann_src
        target.append(_c_object(index, name) if sym_type in ("OBJECT", "TLS") else _c_function(index, name))

    sources = {"cann_stub.c": cann_src, "torch_npu_stub.c": npu_src, "empty.c": ["/* soname placeholder */\n"]}
    for fname, chunks in sources.items():
        (out / fname).write_text("".join(chunks))

    def link(src: str, soname: str, *extra: str) -> None:
        _run(
            ["gcc", "-shared", "-fPIC", "-O1", "-o", str(out / soname), str(out / src), *extra, f"-Wl,-soname,{soname}"]
        )

    link("cann_stub.c", CANN_SONAMES[0], str(manual_obj), "-lstdc++")
    for soname in CANN_SONAMES[1:]:
        link("empty.c", soname)
    link("torch_npu_stub.c", TORCH_NPU_SONAME)

    summary = {"generated": len(wanted), "hand_written": len(manual), "out": str(out)}
    log(f"[gen_stubs] {len(wanted)} symbol(s) generated, {len(manual)} hand-written -> {out}")
    return summary


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: gen_stubs.py <dir containing torchair/> <out dir>")
    generate(sys.argv[1], sys.argv[2])
