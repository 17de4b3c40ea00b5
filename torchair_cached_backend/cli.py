"""``torchair-cache`` / ``python -m torchair_cached_backend``: inspect and maintain a cache dir."""

from __future__ import annotations

import argparse
import os
import sys
import time

from .options import default_cache_dir
from .store import Store


def _entries(root: str):
    for kind in ("graphs", "programs"):
        store = Store(root, kind)
        for key in store.keys():
            yield store, key


def cmd_ls(args: argparse.Namespace) -> int:
    for store, key in _entries(args.cache_dir):
        m = store.read_manifest(key) or {}
        size = sum(f["size"] for f in m.get("files", {}).values())
        age = (time.time() - float(m.get("last_used", 0))) / 3600
        what = m.get("compiler") or m.get("program", {}).get("function", {}).get("qualname", "?")
        print(f"{store.kind:9} {key[:16]}  {size / 1024:9.1f} KiB  used {age:7.1f} h ago  {what}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    bad = 0
    for store, key in list(_entries(args.cache_dir)):
        if store.load(key) is None:  # a broken entry is quarantined by load()
            print(f"broken: {store.kind}/{key[:16]} (moved to quarantine/)")
            bad += 1
    print(f"{bad} broken entr{'y' if bad == 1 else 'ies'}")
    return 1 if bad else 0


def cmd_explain(args: argparse.Namespace) -> int:
    from .key import explain_difference

    a = Store(args.cache_dir, "graphs").read_manifest(args.key_a) or {}
    b = Store(args.cache_dir, "graphs").read_manifest(args.key_b) or {}
    for line in explain_difference(a.get("factors", {}), b.get("factors", {})) or ["no difference in key factors"]:
        print(line)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from .readable import readable_cache

    readable_cache(args.path)
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    if not os.path.isfile(os.path.join(args.cache_dir, "CACHEDIR.TAG")):
        print(f"refusing: {args.cache_dir} has no CACHEDIR.TAG, it is not a cache we created", file=sys.stderr)
        return 2
    n = sum(store.remove(key) for store, key in list(_entries(args.cache_dir)))
    print(f"removed {n} entries")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchair-cache", description=__doc__)
    parser.add_argument("--cache-dir", default=default_cache_dir())
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ls", help="list entries").set_defaults(fn=cmd_ls)
    sub.add_parser("validate", help="verify every checksum; quarantine broken entries").set_defaults(fn=cmd_validate)
    p = sub.add_parser("explain", help="why two graph entries differ (key factors)")
    p.add_argument("key_a")
    p.add_argument("key_b")
    p.set_defaults(fn=cmd_explain)
    p = sub.add_parser("show", help="readable dump of cached programs under PATH")
    p.add_argument("path")
    p.set_defaults(fn=cmd_show)
    sub.add_parser("clear", help="remove all entries").set_defaults(fn=cmd_clear)
    args = parser.parse_args(argv)
    args.cache_dir = os.path.abspath(args.cache_dir)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
