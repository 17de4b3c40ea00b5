"""One process of the invalidation matrix: every case of one (compiler, route) in one phase.

Run as ``python tests/guard_child.py CONFIG.json``. For each case it builds the phase's subjects,
compiles (cold) or warm-starts them, runs the phase's steps and compares every output with the
eager output of the phase's program, computed in this same process on the same inputs. One
JSON line per case is appended to the output file as soon as the case is done, so a process
that dies in a case still reports every case before it (the parent re-runs the rest).

The cold phase also stores, per warm call, the eager output of the COLD program on the warm
inputs (cold state, no autocast / default dtype): a failure message says when a stale output
is exactly that answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
import traceback
from typing import Any

PACKAGE = "torchair_cached_backend"


def contexts(name: str) -> contextlib.AbstractContextManager[Any]:
    import torch

    stack = contextlib.ExitStack()
    if name == "grad":
        stack.enter_context(torch.enable_grad())
        return stack
    stack.enter_context(torch.no_grad())
    if name == "autocast":
        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
    elif name == "float64":
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        stack.callback(torch.set_default_dtype, previous)
    elif name != "no_grad":
        raise ValueError(name)
    return stack


def summary(x: Any) -> Any:
    """A short JSON description of an output, for failure messages."""
    import torch

    if isinstance(x, torch.Tensor):
        flat = x.detach().float().reshape(-1)[:4].tolist()
        return f"tensor(dtype={str(x.dtype).replace('torch.', '')}, shape={tuple(x.shape)}, requires_grad={x.requires_grad}, " \
               f"first={[round(v, 4) for v in flat]})"
    if isinstance(x, (tuple, list)):
        return [summary(v) for v in x]
    if isinstance(x, dict):
        return {str(k): summary(v) for k, v in x.items()}
    if dataclasses.is_dataclass(x):
        return {f.name: summary(getattr(x, f.name)) for f in dataclasses.fields(x)}
    return repr(x)


def mismatch(got: Any, want: Any, where: str = "output") -> str | None:
    """None when ``got`` equals ``want`` (type, structure, dtype, shape, requires_grad, values)."""
    import torch

    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{where}: expected a tensor, got {type(got).__name__}"
        for attr in ("dtype", "shape", "requires_grad"):
            if getattr(got, attr) != getattr(want, attr):
                return f"{where}: {attr} {getattr(got, attr)} != {getattr(want, attr)}"
        tol = 2e-2 if want.dtype in (torch.bfloat16, torch.float16) else 1e-4
        if not torch.allclose(got.detach(), want.detach(), rtol=tol, atol=tol):
            diff = (got.detach().double() - want.detach().double()).abs().max().item()
            return f"{where}: values differ (max abs diff {diff:.4g})"
        return None
    if type(got) is not type(want):
        return f"{where}: type {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, (tuple, list)):
        if len(got) != len(want):
            return f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            if (m := mismatch(g, w, f"{where}[{i}]")) is not None:
                return m
        return None
    if isinstance(want, dict):
        if list(got) != list(want):
            return f"{where}: keys {list(got)} != {list(want)}"
        for k in want:
            if (m := mismatch(got[k], want[k], f"{where}[{k!r}]")) is not None:
                return m
        return None
    return None if got == want else f"{where}: {got!r} != {want!r}"


def error_record(exc: BaseException, words: tuple[str, ...]) -> dict[str, Any]:
    cls = type(exc)
    message = str(exc)
    from_package = cls.__module__.split(".")[0] == PACKAGE
    names_problem = any(w.lower() in message.lower() for w in words)
    return {
        "type": f"{cls.__module__}.{cls.__qualname__}",
        "message": message[:600],
        "from_package": from_package,
        "names_problem": names_problem,
        "where": "".join(traceback.format_exception(exc)[-3:])[-800:],
    }


def inductor_files(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path)) if os.path.isdir(path) else 0


class Runner:
    def __init__(self, cfg: dict[str, Any]) -> None:
        import guard_cases
        import torch

        import torchair_cached_backend as tcb

        self.torch, self.tcb, self.cases = torch, tcb, guard_cases
        self.phase, self.compiler, self.route, self.root = cfg["phase"], cfg["compiler"], cfg["route"], cfg["root"]

    def case_dir(self, name: str) -> str:
        return os.path.join(self.root, "cache", name)

    def ref_path(self, name: str) -> str:
        return os.path.join(self.root, "stale_refs", f"{name}.pt")

    def compiled(self, case: Any, subject: Any) -> Any:
        torch, tcb = self.torch, self.tcb
        options = case.options(self.phase)
        if self.route == "cache_compile":
            target = subject.inner if isinstance(subject, torch.nn.Module) else subject
            return tcb.cache_compile(
                target, cache_dir=self.case_dir(case.name), compiler=self.compiler, dynamic=case.dynamic, **options
            )
        if self.phase == "cold" or self.route == "backend":
            return torch.compile(
                subject,
                backend="npu_cached",
                dynamic=case.dynamic,
                options={"cache_dir": self.case_dir(case.name), "compiler": self.compiler, **options},
            )
        return tcb.load(subject, self.case_dir(case.name), compiler=self.compiler, dynamic=case.dynamic, **options)

    def eager(self, subject: Any) -> Any:
        if self.route == "cache_compile" and isinstance(subject, self.torch.nn.Module):
            return subject.inner
        return subject  # a module is called as a module: its own hooks run

    def counters(self) -> dict[str, Any]:
        from child_helpers import frames

        s = self.tcb.stats().as_dict()
        return {
            "bypass_loads": s["bypass_loads"],
            "fallbacks": s.get("fallbacks", 0),
            "frames": frames(),
            "dynamo": "torch._dynamo" in sys.modules,
            "inductor": "torch._inductor" in sys.modules,
            "inductor_files": inductor_files(os.environ["TORCHINDUCTOR_CACHE_DIR"]),
        }

    def run_case(self, name: str) -> dict[str, Any]:
        case = self.cases.CASES[name]
        t0 = time.perf_counter()
        before = self.counters()
        subjects = case.build(self.phase, os.path.join(self.root, "work"))
        compiled: dict[str, Any] = {}
        for key, subject in subjects.items():
            try:
                compiled[key] = self.compiled(case, subject)
            except Exception as exc:  # reported per step
                compiled[key] = exc
        stale = self.load_stale(name) if self.phase == "warm" else {}
        steps = case.warm_steps() if self.phase == "warm" else case.cold_steps()
        records = [self.step(case, step, subjects, compiled, stale) for step in steps]
        after = self.counters()
        result = {
            "case": name,
            "steps": records,
            "subjects": len(subjects),
            "before": before,
            "after": after,
            "seconds": round(time.perf_counter() - t0, 3),
        }
        if self.phase == "cold":
            self.save_stale(case, subjects)
        return result

    def step(self, case: Any, step: Any, subjects: dict[str, Any], compiled: dict[str, Any], stale: dict[str, Any]) -> dict[str, Any]:
        if isinstance(step, self.cases.Do):
            step.fn(subjects)
            return {"label": step.label, "outcome": "done"}
        record: dict[str, Any] = {"label": step.label, "subject": step.subject, "ctx": step.ctx}
        fn = compiled[step.subject]
        got, error = None, None
        args, kwargs = step.make()
        if isinstance(fn, Exception):
            error = fn
        else:
            try:
                with contexts(step.ctx):
                    got = fn(*args, **kwargs)
            except Exception as exc:  # classified below
                error = exc
        args, kwargs = step.make()
        # torchair's cache_compile (and ours, its drop-in) runs every call under torch.no_grad()
        ref_ctx = "no_grad" if self.route == "cache_compile" and step.ctx == "grad" else step.ctx
        try:
            with contexts(ref_ctx):
                want = case.reference(self.eager(subjects[step.subject]), args, kwargs, self.phase, self.compiler)
        except Exception as exc:
            record.update(outcome="eager_failed", error=error_record(exc, ()))
            return record
        record["eager"] = summary(want)
        if step.label in stale:
            record["stale"] = summary(stale[step.label])
        if error is not None:
            err = error_record(error, case.error_words)
            record["error"] = err
            if err["from_package"] and err["names_problem"]:
                record["outcome"] = "error"
            else:
                record["outcome"] = "unclear_error" if err["from_package"] else "crash"
            return record
        record["got"] = summary(got)
        diff = mismatch(got, want)
        if diff is None:
            record["outcome"] = "correct"
        else:
            record["diff"] = diff
            record["outcome"] = "stale"  # a silently wrong output: the replayed program answered for another one
            record["equals_cold_program"] = step.label in stale and mismatch(got, stale[step.label]) is None
        return record

    def save_stale(self, case: Any, subjects: dict[str, Any]) -> None:
        """The cached program's answer to every warm call: its eager output on the warm inputs."""
        refs = {}
        for step in case.warm_steps():
            if isinstance(step, self.cases.Do) or step.subject not in subjects:
                continue
            args, kwargs = step.make()
            try:
                with contexts("no_grad"):
                    refs[step.label] = case.reference(self.eager(subjects[step.subject]), args, kwargs, "cold", self.compiler)
            except Exception:  # the cold program cannot take these inputs: no stale answer
                continue
        path = self.ref_path(case.name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.torch.save(refs, path)

    def load_stale(self, name: str) -> dict[str, Any]:
        path = self.ref_path(name)
        return self.torch.load(path, weights_only=False) if os.path.exists(path) else {}


def main(config_path: str) -> None:
    with open(config_path) as f:
        cfg = json.load(f)
    runner = Runner(cfg)
    with open(cfg["out"], "a") as out:
        for name in cfg["cases"]:
            out.write(json.dumps({"start": name}) + "\n")
            out.flush()
            try:
                result = runner.run_case(name)
            except Exception as exc:  # a case that cannot even be built is reported, not fatal
                result = {"case": name, "case_error": "".join(traceback.format_exception(exc))[-3000:]}
            out.write(json.dumps(result, default=str) + "\n")
            out.flush()


if __name__ == "__main__":
    main(sys.argv[1])
