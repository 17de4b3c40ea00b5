"""``torchair-cache`` / ``python -m torchair_cached_backend``: inspect, maintain and ship caches.

Every command takes the directory as a positional argument (``--cache-dir`` works
too; the default is ``$TORCHAIR_CACHE_HOME`` or ``./.torchair_cache``) and works
on any level of a cache tree: a ``cache_compile`` root, a model, a rank, a
function dir, or a single entry.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from .fs_security import CacheSecurityError
from .inventory import Located, LookupFailed, disk_size, find_entries, resolve_key
from .options import OptionError, default_cache_dir, parse_size
from .store import FILES_DIR, TAG, BrokenEntry


class CliError(Exception):
    """A user error: printed as ``torchair-cache: error: ...``, exit status 2."""


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _ago(ts: float) -> str:
    if not ts:
        return "never"
    s = max(time.time() - ts, 0.0)
    for unit, div in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= div:
            return f"{s / div:.1f} {unit} ago"
    return f"{s:.0f} s ago"


def _dir(args: argparse.Namespace) -> str:
    path = getattr(args, "dir", None) or args.cache_dir or default_cache_dir()
    return os.path.abspath(path)


def _entries(path: str) -> list[Located]:
    if not os.path.exists(path):
        raise CliError(f"{path} does not exist")
    try:
        return find_entries(path)
    except LookupFailed as exc:
        raise CliError(str(exc)) from None


def _what(m: dict[str, Any]) -> str:
    program = m.get("program") or {}
    if program:
        return str((program.get("function") or {}).get("qualname", "?"))
    return str(m.get("compiler", "?"))


# ---------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------


def cmd_ls(args: argparse.Namespace) -> int:
    path = _dir(args)
    if os.path.isfile(path):
        return _ls_bundle(path)
    rows = _entries(path)
    total = 0
    current_root = None
    for e in rows:
        if e.rel_root != current_root and e.rel_root != ".":
            print(f"{e.rel_root}/")
        current_root = e.rel_root
        size = disk_size(e.path)
        total += size
        indent = "  " if e.rel_root != "." else ""
        try:
            m = e.store.read_manifest(e.key) or {}
        except (BrokenEntry, OSError) as exc:  # CacheSecurityError is an OSError
            print(f"{indent}{e.store.kind:9} {e.key[:16]}  {_human(size):>10}  BROKEN: {exc}")
            continue
        used = float(m.get("last_used", 0) or 0) if isinstance(m.get("last_used"), (int, float)) else 0.0
        print(f"{indent}{e.store.kind:9} {e.key[:16]}  {_human(size):>10}  used {_ago(used):>12}  {_what(m)}")
        if e.store.kind == "graphs":
            _ls_runtime(e, indent)
    print(f"{len(rows)} entr{'y' if len(rows) == 1 else 'ies'}, {_human(total)}")
    return 0


def _ls_runtime(e: Located, indent: str) -> None:
    """An entry's run-time caches (GE's compiled model...): names and sizes checked against the seal, no hashing."""
    from .runtime_status import SEALED, statuses

    for st in statuses(os.path.join(e.path, FILES_DIR)):
        state = st.state if st.state == SEALED or not st.detail else f"{st.state}: {st.detail}"
        print(f"{indent}  run-time cache {st.name:15} {_human(st.size):>10}  {state}")


def _ls_bundle(path: str) -> int:
    from .bundle import BundleError, read_manifest

    try:
        manifest = read_manifest(path)
    except BundleError as exc:
        raise CliError(str(exc)) from None
    for e in manifest["entries"]:
        torch_version = (e.get("versions") or {}).get("torch", "?")
        where = f"{e['root']}/" if e["root"] else ""
        print(f"{where}{e['kind']:9} {e['key'][:16]}  {_human(e['size']):>10}  torch {torch_version}")
    print(f"{len(manifest['entries'])} entries, {_human(manifest.get('total_size', 0))} (bundle {path})")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """Linear: one read per entry, one sweep per store. Only the directory that was read
    and found broken is quarantined (a writer may have replaced it since); an entry that
    is refused (a symlink, another owner) is reported and skipped, and the rest goes on."""
    bad = bad_runtime = 0
    path = _dir(args)
    swept: set[tuple[str, str]] = set()
    for e in _entries(path):
        if (e.store.root, e.store.kind) not in swept:
            swept.add((e.store.root, e.store.kind))
            e.store.sweep()
        name = f"{e.store.kind}/{e.key[:16]}"
        try:
            entry = e.store.read_verified(e.key)
        except CacheSecurityError as exc:
            bad += 1
            print(f"refused: {name} ({exc}); skipped, not touched")
            continue
        except BrokenEntry as exc:
            bad += 1
            if not e.store.writable():
                print(f"broken: {name} ({exc}); read-only cache dir, left in place")
                continue
            e.store.quarantine(e.key, str(exc), identity=exc.identity)
            print(f"broken: {name} ({exc}); moved to quarantine/")
            continue
        except OSError as exc:
            bad += 1
            print(f"unreadable: {name} ({exc.strerror or exc}); left in place")
            continue
        if entry is None:
            print(f"changed: {name} was removed or replaced while being checked; skipped")
        elif e.store.kind == "graphs":
            bad_runtime += _validate_runtime(e, name)
    caches = f", {bad_runtime} broken run-time cache{'' if bad_runtime == 1 else 's'}" if bad_runtime else ""
    print(f"{bad} broken entr{'y' if bad == 1 else 'ies'}{caches}")
    return 1 if bad or bad_runtime else 0


def _validate_runtime(e: Located, name: str) -> int:
    """Hash an entry's run-time caches against their seals; a broken one (or an unsealed one no
    process is writing) is set aside for GE to rebuild, as ``prepare`` would at the next start."""
    from .runtime_status import BROKEN, UNSEALED, WRITING, validate

    writable = e.store.writable()
    bad = 0
    for st in validate(os.path.join(e.path, FILES_DIR), fix=writable):
        if st.state == WRITING:
            print(f"busy: {name} run-time cache {st.name} is being written; skipped")
        elif st.state == BROKEN or (st.state == UNSEALED and st.detail != "empty"):
            bad += 1
            where = "" if writable else "; read-only cache dir, left in place"
            print(f"broken: {name} run-time cache {st.name} ({st.detail}{where})")
    return bad


def cmd_explain(args: argparse.Namespace) -> int:
    from .key import explain_difference

    if args.here:  # why does this machine miss SOURCE's entries (a cache dir, a bundle, a remote)?
        from .fleet_explain import explain_here

        try:
            lines = explain_here(args.here)
        except Exception as exc:  # noqa: BLE001 - unreadable source: a clear error, exit 2
            raise CliError(f"cannot read {args.here}: {type(exc).__name__}: {exc}") from None
        print("\n".join(lines))
        return 0
    if not args.key_a or not args.key_b:
        raise CliError("explain needs KEY_A KEY_B [DIR], or --here SOURCE (a cache dir, bundle or redis:// URL)")
    entries = _entries(_dir(args))
    try:
        a, b = (resolve_key(entries, k) for k in (args.key_a, args.key_b))
    except LookupFailed as exc:
        raise CliError(str(exc)) from None
    if a.key == b.key:
        print(f"{args.key_a} and {args.key_b} are the same entry ({a.key[:16]})")
        return 0
    try:
        ma, mb = (e.store.read_manifest(e.key) or {} for e in (a, b))
    except (BrokenEntry, OSError) as exc:
        raise CliError(f"cannot read an entry's manifest: {exc}") from None
    for line in explain_difference(ma.get("factors", {}), mb.get("factors", {})) or [
        "no difference in the recorded key factors (the keys differ in a factor not recorded readably)"
    ]:
        print(line)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from .readable import readable_cache

    readable_cache(_dir(args))
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    path = _dir(args)
    entries = _entries(path)
    roots = sorted({e.store.root for e in entries})
    untagged = [r for r in roots if not os.path.isfile(os.path.join(r, TAG))]
    if untagged:
        raise CliError(f"refusing: {untagged[0]} has no {TAG}, it is not a cache we created")
    n = refused = 0
    for e in entries:
        try:
            n += e.store.remove(e.key)
        except CacheSecurityError as exc:
            refused += 1
            print(f"refused: {e.store.kind}/{e.key[:16]} ({exc}); skipped")
    print(f"removed {n} entries" + (f", {refused} refused" if refused else ""))
    return 1 if refused else 0


def cmd_prune(args: argparse.Namespace) -> int:
    from .prune import prune

    try:
        max_size = parse_size(args.max_size)
    except OptionError as exc:
        raise CliError(str(exc)) from None
    path = _dir(args)
    _entries(path)
    report = prune(path, max_size, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for name in report.removed:
        print(f"{verb} {name}")
    for name in report.busy:
        print(f"skipped {name} (in use)")
    for name in report.refused:
        print(f"refused {name} (a symlink or another user's entry; remove it by hand)")
    print(f"{_human(report.size_before)} -> {_human(report.size_after)} (max {_human(max_size)}); "
          f"{verb} {len(report.removed)}, {len(report.busy)} in use")
    return 0 if report.size_after <= max_size else 1


def _limits(args: argparse.Namespace) -> Any:
    from .bundle import Limits

    try:
        return Limits(
            max_member_size=parse_size(args.max_member_size),
            max_total_size=parse_size(args.max_total_size),
            max_members=int(args.max_members),
        )
    except (OptionError, ValueError) as exc:
        raise CliError(str(exc)) from None


def _bundle_call(fn: Any, *a: Any, **kw: Any) -> dict[str, Any]:
    from .bundle import BundleError

    try:
        return fn(*a, **kw)
    except BundleError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:  # a read-only or full target, a missing file...
        raise CliError(f"{exc.strerror or exc}: {exc.filename or ''}") from None


def cmd_pack(args: argparse.Namespace) -> int:
    from .bundle import pack

    if len(args.paths) > 2:
        raise CliError("pack takes CACHE_DIR BUNDLE (or BUNDLE alone, with --cache-dir)")
    if len(args.paths) == 1:
        cache_dir, bundle = args.cache_dir or default_cache_dir(), args.paths[0]
    else:
        cache_dir, bundle = args.paths
    found = _entries(os.path.abspath(cache_dir))
    if not found:
        raise CliError(f"no cache entries under {cache_dir}; nothing to pack")
    out = _bundle_call(pack, cache_dir, bundle, compression=args.compression)
    for line in out["skipped_broken"]:
        print(f"skipped broken entry {line}")
    print(f"packed {out['entries']} entries ({_human(out['payload_bytes'])}) into {bundle} "
          f"({_human(out['bundle_bytes'])}{', signed' if out['signed'] else ', unsigned'}) in {out['seconds']:.2f}s")
    return 0


def _warn_versions(summary: dict[str, Any]) -> None:
    from .environment import environment_factors

    here = environment_factors()
    for versions in summary["versions"]:
        changed = [f"{k} {versions.get(k)} (here {here.get(k)})" for k in here if versions.get(k) != here.get(k)]
        if changed:
            print(f"note: entries built under {', '.join(changed)}: they are not used on this machine (kept until pruned)")


def cmd_unpack(args: argparse.Namespace) -> int:
    from .bundle import unpack

    cache_dir = args.target or args.cache_dir or default_cache_dir()
    out = _bundle_call(unpack, args.bundle, cache_dir, limits=_limits(args))
    print(f"unpacked {args.bundle} into {out['cache_dir']}: {out['published']} entries published, "
          f"{out['kept']} already present ({out.get('runtime_caches_added', 0)} run-time caches added to them), "
          f"{out['merged']} programs merged; signature {out['signature']}; {out['seconds']:.2f}s")
    _warn_versions(out)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .bundle import verify

    out = _bundle_call(verify, args.bundle, limits=_limits(args))
    print(f"{args.bundle}: OK, {out['entries']} entries, {_human(out['payload_bytes'])}, signature {out['signature']}")
    _warn_versions(out)
    return 0


def _option_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def cmd_prebuild(args: argparse.Namespace) -> int:
    import logging

    from .logs import log
    from .prebuilding import load_spec, prebuild

    if not args.quiet:  # progress lines and each graph compile, on stderr
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    options = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            raise CliError(f"-o expects KEY=VALUE, got {item!r}")
        options[key] = _option_value(value)
    try:
        target, inputs = load_spec(args.spec)
        report = prebuild(target, inputs, _dir(args), **options)
    except (ValueError, OptionError) as exc:
        raise CliError(str(exc)) from None
    print(f"prebuilt {report.cache_dir}: {report.calls} calls, {report.compiled} graphs compiled, {report.hits} "
          f"already cached, {report.uncached} uncached, {report.storage_faults} storage faults, {report.seconds:.1f}s")
    if report.replayable is False:
        print(f"warning: a warm start will not replay without Dynamo: {report.why_not}")
    if args.pack:
        return cmd_pack(argparse.Namespace(paths=[report.cache_dir, args.pack], compression=None, cache_dir=None))
    return 0 if report.storage_faults == 0 else 1


# ---------------------------------------------------------------------------
# argument parsing
# ---------------------------------------------------------------------------


def _with_dir(p: argparse.ArgumentParser, what: str = "a cache dir (any level of the layout)") -> None:
    p.add_argument("dir", nargs="?", metavar="DIR", help=f"{what}; default --cache-dir")
    p.add_argument("--cache-dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _with_limits(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-member-size", default="4GiB", help="refuse a member larger than this (default 4GiB)")
    p.add_argument("--max-total-size", default="64GiB", help="refuse a bundle unpacking to more (default 64GiB)")
    p.add_argument("--max-members", default=100_000, type=int, help="refuse more members (default 100000)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchair-cache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=None, help="cache dir (default $TORCHAIR_CACHE_HOME or ./.torchair_cache)")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("ls", help="list entries (size, last use) of a cache dir, or of a bundle file")
    _with_dir(p, "a cache dir or a bundle file")
    p.set_defaults(fn=cmd_ls)
    p = sub.add_parser("validate", help="verify every checksum; quarantine broken entries")
    _with_dir(p)
    p.set_defaults(fn=cmd_validate)
    p = sub.add_parser("explain", help="why two graph entries differ (key factors; keys as `ls` prints them), "
                                       "or with --here SOURCE why this machine misses SOURCE's entries")
    p.add_argument("key_a", nargs="?")
    p.add_argument("key_b", nargs="?")
    p.add_argument("--here", metavar="SOURCE", help="a cache dir, a bundle or a redis:// URL: list the machine factors "
                                                    "(ISA, codegen env, versions...) its graphs differ in from this process")
    _with_dir(p)
    p.set_defaults(fn=cmd_explain)
    p = sub.add_parser("show", help="readable dump of cached programs under DIR")
    _with_dir(p)
    p.set_defaults(fn=cmd_show)
    p = sub.add_parser("clear", help="remove all entries")
    _with_dir(p)
    p.set_defaults(fn=cmd_clear)
    p = sub.add_parser("prune", help="remove least recently used entries until the cache fits --max-size")
    _with_dir(p)
    p.add_argument("--max-size", required=True, help="e.g. 500MB, 2GB")
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p.set_defaults(fn=cmd_prune)
    p = sub.add_parser("pack", help="pack a cache dir into a bundle: pack [CACHE_DIR] BUNDLE")
    p.add_argument("paths", nargs="+", metavar="CACHE_DIR BUNDLE")
    p.add_argument("--compression", choices=("none", "gz", "xz"), default=None,
                   help="default: from the bundle name (.tar, .tar.gz/.tgz, .tar.xz/.txz)")
    p.add_argument("--cache-dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.set_defaults(fn=cmd_pack)
    p = sub.add_parser("unpack", help="check a bundle completely, then publish its entries: unpack BUNDLE [CACHE_DIR]")
    p.add_argument("bundle")
    p.add_argument("target", nargs="?", metavar="CACHE_DIR")
    p.add_argument("--cache-dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    _with_limits(p)
    p.set_defaults(fn=cmd_unpack)
    p = sub.add_parser("verify", help="check a bundle completely without writing anything")
    p.add_argument("bundle")
    _with_limits(p)
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser("prebuild", help="fill a cache for example inputs: prebuild MODULE:FN [CACHE_DIR]")
    p.add_argument("spec", help="MODULE:CALLABLE or FILE.py:CALLABLE returning (target, inputs_list)")
    _with_dir(p)
    p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an npu_cached option, e.g. -o compiler=eager -o dynamic=false (JSON values)")
    p.add_argument("--pack", metavar="BUNDLE", help="pack the filled cache into BUNDLE")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.set_defaults(fn=cmd_prebuild)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cache_dir is not None:
        args.cache_dir = os.path.abspath(args.cache_dir)
    try:
        return int(args.fn(args))
    except CliError as exc:
        print(f"torchair-cache: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
