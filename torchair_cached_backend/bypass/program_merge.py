"""Merging two programs of one key: what a process that compiled new variants writes.

The union of frames, variants and resume variants, bounded by ``max_variants``
(the oldest go, never one this process replayed or compiled), and the frames and
blobs nothing refers to any more dropped. Only writers import this module.
"""

from __future__ import annotations

from typing import Any

from .program import MAX_VARIANTS, PROGRAM_FORMAT


def merge_programs(
    old: dict[str, Any] | None,
    old_files: dict[str, bytes],
    new: dict[str, Any],
    new_files: dict[str, bytes],
    max_variants: int = MAX_VARIANTS,
    keep: set[str] = frozenset(),  # type: ignore[assignment]
) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Union of two programs of one key: frames by id, variants by root frame (the
    newest last), resume variants per group. Beyond ``max_variants`` the oldest go,
    except the new ones and ``keep`` (the variants this process replayed)."""
    if not old or old.get("format") != PROGRAM_FORMAT:
        merged = dict(new)
        merged["variants"] = _bounded(list(new.get("variants", [])), max_variants, keep)
        return _prune(merged, dict(new_files))
    merged = dict(new)
    merged["frames"] = {**old.get("frames", {}), **new.get("frames", {})}
    # a variant already stored keeps its place and record, so re-capturing the same frames
    # (every warm torch.compile process does) changes nothing and writes nothing
    known = {v["root"] for v in old.get("variants", [])}
    added = [v for v in new.get("variants", []) if v["root"] not in known]
    protected = set(keep) | {v["root"] for v in new.get("variants", [])}
    merged["variants"] = _bounded(list(old.get("variants", [])) + added, max_variants, protected)
    resumes = {k: dict(v, frames=list(v.get("frames", []))) for k, v in old.get("resumes", {}).items()}
    for origin, group in new.get("resumes", {}).items():
        mine = resumes.setdefault(origin, dict(group, frames=[]))
        if group.get("python"):  # Dynamo ran it as Python in some process (used only while it has no frame)
            mine["python"] = True
        for fid in group.get("frames", []):
            if fid not in mine["frames"]:
                mine["frames"].append(fid)
        ours = set(group.get("frames", []))
        mine["frames"] = _bounded_ids(mine["frames"], max_variants, ours)
    merged["resumes"] = resumes
    merged["callees"] = list(old.get("callees", []))
    merged["callees"] += [c for c in new.get("callees", []) if c not in merged["callees"]]
    merged["eager_root"] = bool(old.get("eager_root") or new.get("eager_root"))
    return _prune(merged, {**old_files, **new_files})


def _bounded(variants: list[dict[str, Any]], bound: int, protected: set[str]) -> list[dict[str, Any]]:
    """Drop the oldest unprotected variants until at most ``bound`` remain (or none is left to drop)."""
    roots = _bounded_ids([v["root"] for v in variants], bound, protected)
    kept = set(roots)
    return [v for v in variants if v["root"] in kept]


def _bounded_ids(ids: list[str], bound: int, protected: set[str]) -> list[str]:
    excess = len(ids) - bound
    out = []
    for fid in ids:
        if excess > 0 and fid not in protected:
            excess -= 1
            continue
        out.append(fid)
    return out


def _prune(program: dict[str, Any], files: dict[str, bytes]) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Drop frames (and their blobs) no variant or resume group refers to."""
    used = {v["root"] for v in program.get("variants", [])}
    for group in program.get("resumes", {}).values():
        used.update(group.get("frames", []))
    frames = {fid: f for fid, f in program.get("frames", {}).items() if fid in used}
    program = dict(program, frames=frames)
    keep = set()
    for frame in frames.values():
        keep.add(frame["code"])
        guards = frame.get("guards") or {}
        if guards.get("code"):
            keep.add(guards["code"])
    for group in program.get("resumes", {}).values():
        if group.get("code"):
            keep.add(group["code"])
    return program, {name: data for name, data in files.items() if name in keep}
