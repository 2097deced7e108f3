"""Runs one case: builds its input sets, checks every implementation against the eager
reference once, then times each. Nothing here imports the fusebox operators at module load:
:func:`load_fusebox` does, when a GPU run starts."""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence, Tuple

import torch

from . import baselines
from .suite import DTYPES, Case, build_inputs
from .timing import SMALL_BYTES, Timer, median, plan_sets, short_error

IMPLS = ("fusebox", "eager", "torch", "compile", "liger")
BASELINES = IMPLS[1:]
# the order they run in: eager first (the reference), fusebox before Liger (whose rope rotates
# its inputs in place)
RUN_ORDER = ("eager", "fusebox", "torch", "compile", "liger")
# Cases of up to this many bytes (a few microseconds) are timed a second time in reverse order and
# each implementation's samples of both passes pooled, device times and host latency alike: where
# an implementation runs in the order moved decode-sized timings by 0.2 us (bench/NOTES.md, "the
# bench's run order"), and a slower stretch of the host would fall on one implementation alone.
BALANCED_ORDER_BYTES = 16 << 20


class CudaContextLost(RuntimeError):
    """A CUDA error that leaves the context unusable (illegal address, launch failure)."""


def load_fusebox() -> Tuple[Optional[object], Optional[str]]:
    """``(fusebox.functional, None)`` or ``(None, why not)``."""
    try:
        import fusebox.functional as fb  # noqa: WPS433 - imported lazily on purpose
        from fusebox import _ops
    except Exception as e:  # noqa: BLE001
        return None, short_error(e, 500)
    err = getattr(_ops, "LOAD_ERROR", None)      # if _ops ever tolerates a missing library
    if err is not None:
        return None, short_error(err, 500) if isinstance(err, BaseException) else str(err)
    return fb, None


def _bind(f: Callable, p: dict, mod=None) -> Callable:
    if mod is None:
        def call(t):
            return f(t, p)
    else:
        def call(t):
            return f(mod, t, p)
    return call


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def rel_err(out, ref) -> Optional[float]:
    """``||out - ref|| / ||ref||`` over all outputs, in float64; inf on NaN or a shape
    mismatch."""
    outs, refs = _as_tuple(out), _as_tuple(ref)
    if len(outs) != len(refs):
        return float("inf")
    num = den = 0.0
    for a, b in zip(outs, refs):
        if a is None or b is None:
            continue
        if tuple(a.shape) != tuple(b.shape):
            return float("inf")
        a64, b64 = a.detach().double(), b.detach().double()
        if not bool(torch.isfinite(a64).all()):
            return float("inf")
        num += float((a64 - b64).pow(2).sum())
        den += float(b64.pow(2).sum())
        del a64, b64
    return (num ** 0.5) / (den ** 0.5) if den > 0 else (0.0 if num == 0 else float("inf"))


def _cuda_alive() -> bool:
    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001
        return False


class Runner:
    def __init__(self, timer: Timer, use_compile: bool = True, use_liger: bool = True):
        self.timer = timer
        self.use_compile = use_compile
        self.use_liger = use_liger
        self.fb, self.fb_error = load_fusebox()
        self._lk = None
        self._lk_error: Optional[str] = None
        self._copy_us: dict = {}           # same-size copy times, by (bytes, timing mode)
        if use_liger:
            try:
                self._lk = baselines.import_liger()
            except ImportError as e:
                self._lk_error = str(e)

    @property
    def liger_status(self) -> str:
        if not self.use_liger:
            return "disabled (--no-liger)"
        return "available" if self._lk is not None else (self._lk_error or "absent")

    def impl(self, name: str, case: Case):
        """(callable, None) or (None, {"absent": reason, "kind": ...})."""
        spec, p = case.spec, case.params
        if name == "eager":
            return _bind(spec.eager, p), None
        if name == "fusebox":
            if self.fb is None:
                return None, {"absent": f"fusebox not loaded: {self.fb_error}", "kind": "error"}
            return _bind(spec.fusebox, p, self.fb), None
        if name == "torch":
            if spec.torch is None:
                return None, {"absent": "no fused PyTorch op", "kind": "n/a"}
            return _bind(spec.torch, p), None
        if name == "compile":
            if not self.use_compile:
                return None, {"absent": "disabled (--no-compile)", "kind": "disabled"}
            torch._dynamo.reset()
            return torch.compile(_bind(spec.eager, p), fullgraph=True, dynamic=False), None
        if name == "liger":
            if not self.use_liger:
                return None, {"absent": "disabled (--no-liger)", "kind": "disabled"}
            if self._lk is None:
                return None, {"absent": self._lk_error or "liger_kernel absent", "kind": "error"}
            if spec.liger is None:
                return None, {"absent": "Liger has no such op", "kind": "n/a"}
            return _bind(spec.liger, p, self._lk), None
        raise KeyError(name)

    def run_case(self, case: Case, impls: Sequence[str] = RUN_ORDER) -> dict:
        """Times ``impls`` (in run order) on fresh inputs of ``case``."""
        nbytes = case.nbytes
        sets_n, flush = plan_sets(nbytes, self.timer.l2)
        small = nbytes <= 2 * SMALL_BYTES
        rec = {
            "key": case.key, "op": case.op, "group": case.group, "shape": case.label,
            "dtype": case.dtype, "params": case.params, "bytes": nbytes,
            "timing": {"mode": "flush" if flush else "rotate", "sets": sets_n, "small": small},
            "impls": {},
        }
        sets = [build_inputs(case, "cuda", seed=i) for i in range(sets_n)]
        torch.cuda.synchronize()
        ref = None
        fns: dict = {}
        order = [n for n in RUN_ORDER if n in impls]
        try:
            with torch.no_grad():
                for name in order:
                    rec["impls"][name] = self._run_impl(name, case, sets, flush, small, ref, fns)
                    if name == "eager":
                        ref = rec["impls"][name].pop("_out", None)
                if nbytes <= BALANCED_ORDER_BYTES:
                    for name in reversed(order):
                        self._retime_pooled(rec["impls"][name], fns.get(name), sets, flush)
            for m in rec["impls"].values():
                m.pop("_ts", None)
                m.pop("_host_ts", None)
        finally:
            del sets, ref
            if self.use_compile:
                torch._dynamo.reset()
            torch.cuda.empty_cache()
        rec["impls"] = {k: rec["impls"][k] for k in IMPLS if k in rec["impls"]}
        rec["copy_ref"] = self.copy_reference(nbytes, sets_n, flush)
        return rec

    def copy_reference(self, nbytes: int, sets_n: int, flush: bool) -> dict:
        """The time of PyTorch's device copy of the case's bytes (half read, half written), timed
        as the case was: a reference at that size for a kernel that only moves the bytes, where
        the floor takes copy bandwidth from a 1 GB copy (the copy's own path changes with the
        size, so the reference is not smooth in it). Measured once per size and mode, as the
        lower of two medians: a property of the machine, which a clock dip under one measurement
        would otherwise carry into every ratio built on it."""
        key = (nbytes, flush)
        if key not in self._copy_us:
            half = max(nbytes // 2, 1)
            try:
                src = [torch.randint(0, 255, (half,), dtype=torch.uint8, device="cuda")
                       for _ in range(sets_n)]
                pairs = [(a, torch.empty_like(a)) for a in src]
                us = min(self.timer.measure(lambda s: s[1].copy_(s[0]), pairs, flush,
                                            small=False)["us"] for _ in range(2))
                self._copy_us[key] = {"us": us}
                del src, pairs
            except Exception as e:  # noqa: BLE001
                self._copy_us[key] = {"absent": short_error(e), "kind": "error"}
            torch.cuda.empty_cache()
        return dict(self._copy_us[key])

    def _retime_pooled(self, m: dict, fn, sets, flush: bool) -> None:
        """Times `fn` once more, as many calls as its first pass, and pools both passes' samples:
        us, min_us and n then cover both; first_pass_us keeps the first median. The host
        latency's blocks are pooled the same way (host_us, first_pass_host_us), so a slower
        stretch of the host falls on every implementation's samples alike."""
        ts, host = m.get("_ts"), m.get("_host_ts")
        if fn is None or not ts:
            return
        try:
            more = self.timer.device_times(fn, sets, len(ts), flush, m["host_enqueue_us"])
            more_host = self.timer.host_latency_samples(fn, sets[0], blocks=len(host)) if host else []
        except Exception as e:  # noqa: BLE001
            if not _cuda_alive():
                raise CudaContextLost(f"retiming: {short_error(e)}") from e
            return
        pooled = ts + more
        m.update({"first_pass_us": m["us"], "us": median(pooled), "min_us": min(pooled), "n": len(pooled)})
        if host:
            m.update({"first_pass_host_us": m["host_us"], "host_us": median(host + more_host)})

    def _run_impl(self, name, case, sets, flush, small, ref, fns: Optional[dict] = None) -> dict:
        try:
            fn, absent = self.impl(name, case)
        except Exception as e:  # noqa: BLE001
            return {"absent": short_error(e), "kind": "error"}
        if fn is None:
            return absent
        if fns is not None:
            fns[name] = fn
        m: dict = {}
        try:
            t0 = time.perf_counter()
            out = fn(sets[0])
            torch.cuda.synchronize()
            if name == "compile":
                m["compile_s"] = round(time.perf_counter() - t0, 2)
            if name == "eager":
                m["_out"] = out
            elif ref is not None:
                m["err"] = rel_err(out, ref)
            del out
            m.update(self.timer.measure(fn, sets, flush, small, samples=True))
            return m
        except NotImplementedError as e:
            return {"absent": str(e) or "not implemented", "kind": "n/a"}
        except torch.cuda.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            return {"absent": short_error(e), "kind": "error"}
        except Exception as e:  # noqa: BLE001
            if not _cuda_alive():
                raise CudaContextLost(f"{name} on {case.key}: {short_error(e)}") from e
            return {"absent": short_error(e), "kind": "error"}


def environment(runner: Optional[Runner] = None) -> dict:
    """What the results were measured on."""
    import datetime
    import platform

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    try:
        import triton  # type: ignore
        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        env["triton"] = None
    try:
        from importlib.metadata import version
        env["liger_kernel"] = version("liger-kernel")
    except Exception:  # noqa: BLE001
        env["liger_kernel"] = None
    if torch.cuda.is_available():
        prop = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update({
            "gpu": prop.name, "capability": f"{prop.major}.{prop.minor}",
            "sms": prop.multi_processor_count, "memory_gb": round(prop.total_memory / 1e9, 1),
        })
    if runner is not None:
        env["fusebox_loaded"] = runner.fb is not None
        env["fusebox_error"] = runner.fb_error
        env["liger"] = runner.liger_status
    return env


__all__ = ["BASELINES", "IMPLS", "CudaContextLost", "Runner", "environment", "load_fusebox",
           "rel_err", "DTYPES"]
