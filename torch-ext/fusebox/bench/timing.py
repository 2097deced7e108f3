"""Device timing: CUDA events, warm-up, medians; L2 kept out of the numbers.

Kernel time (``us``): each call is bracketed by its own pair of CUDA events. Before a chunk of
calls the GPU is held by ``torch.cuda._sleep`` for longer than the host needs to enqueue the
chunk, so the events measure device time only, not host launch gaps. The L2 is kept cold in one
of two ways, both outside the event window:

* ``rotate``: K input sets whose inputs + outputs together exceed 3x the L2, used in turn; the
  last K outputs stay alive, so output buffers rotate too.
* ``flush`` (sets too small to rotate through 3x L2 with at most ``MAX_SETS`` sets): a
  read-only pass over a buffer of 4x the L2 (>= 256 MB) before each start event, which leaves
  only clean lines behind (no write-back lands in the window).

For small inputs also: ``graph_us`` (CUDA-graph replay of ``GRAPH_CALLS`` back-to-back calls,
per call; caches warm, as in a decode step) and ``host_us`` (wall clock around N back-to-back
eager calls with one sync at the end, per call; the median of 7 blocks of N, of 14 where the
runner times the case again in reverse order).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, List, Optional, Sequence

import torch

from .report import UNSTEADY_RATIO, UNSTEADY_RETIMES

MAX_SETS = 32
GRAPH_CALLS = 20
SMALL_BYTES = 1 << 20          # "inputs under ~1 MB": also graph replay and host latency
DEFAULT_L2 = 50 * 1024 * 1024


def l2_bytes() -> int:
    try:
        n = int(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()),
                        "L2_cache_size", 0))
        return n if n > 0 else DEFAULT_L2
    except Exception:  # noqa: BLE001
        return DEFAULT_L2


def plan_sets(set_bytes: int, l2: int, max_sets: int = MAX_SETS) -> tuple:
    """(number of input sets, flush?) for a set moving ``set_bytes`` (inputs + outputs)."""
    need = 3 * l2
    k = max(2, math.ceil(need / max(set_bytes, 1)))
    if k <= max_sets:
        return k, False
    return 1, True


def _event():
    return torch.cuda.Event(enable_timing=True)


def _sync():
    torch.cuda.synchronize()


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


class Timer:
    def __init__(self, warmup: int = 10, iters: int = 100, min_iters: int = 20,
                 budget_s: float = 0.3, host_calls: int = 50, graph_replays: int = 10):
        self.warmup = warmup
        self.iters = iters
        self.min_iters = min(min_iters, iters)
        self.budget_s = budget_s
        self.host_calls = host_calls
        self.graph_replays = graph_replays
        self.l2 = l2_bytes()
        self._flush_buf = None
        self.cycles_per_us: Optional[float] = None     # set by calibrate()

    # ------------------------------------------------------------------ helpers

    def _calibrate_sleep(self) -> Optional[float]:
        """Cycles of ``torch.cuda._sleep`` per microsecond (the highest seen, so that a hold
        lasts at least as long as asked); None if it is unavailable."""
        try:
            rates = []
            for _ in range(5):
                s, e = _event(), _event()
                s.record()
                torch.cuda._sleep(2_000_000)
                e.record()
                _sync()
                us = s.elapsed_time(e) * 1e3
                if us > 0:
                    rates.append(2_000_000 / us)
            return max(rates) if rates else None
        except Exception:  # noqa: BLE001
            return None

    def _hold_gpu(self, us: float) -> None:
        if self.cycles_per_us:
            torch.cuda._sleep(int(min(us, 200_000.0) * self.cycles_per_us))

    def flush(self) -> None:
        if self._flush_buf is None:
            n = max(256 << 20, 4 * self.l2) // 4
            self._flush_buf = torch.ones(n, dtype=torch.float32, device="cuda")
        self._flush_buf.sum()

    def release(self) -> None:
        self._flush_buf = None

    # ------------------------------------------------------------------ pieces

    def host_enqueue_us(self, fn: Callable, sets: Sequence, n: int = 8,
                        flush: bool = False) -> float:
        """Host time to enqueue one call (GPU held busy meanwhile, so no waiting on it)."""
        _sync()
        self._hold_gpu(50_000)
        t0 = time.perf_counter()
        for i in range(n):
            if flush:
                self.flush()
            fn(sets[i % len(sets)])
        t1 = time.perf_counter()
        _sync()
        return (t1 - t0) / n * 1e6

    def device_times(self, fn: Callable, sets: Sequence, iters: int, flush: bool,
                     host_us: float, chunk: int = 8) -> List[float]:
        k = len(sets)
        ring: list = [None] * k
        times: List[float] = []
        for c0 in range(0, iters, chunk):
            n = min(chunk, iters - c0)
            evs = [(_event(), _event()) for _ in range(n)]
            _sync()
            self._hold_gpu(1.5 * n * (host_us + 10.0) + 50.0)
            for i in range(n):
                j = (c0 + i) % k
                if flush:
                    self.flush()
                s, e = evs[i]
                s.record()
                ring[j] = fn(sets[j])
                e.record()
            _sync()
            times.extend(s.elapsed_time(e) * 1e3 for s, e in evs)
        del ring
        return times

    def graph_us(self, fn: Callable, sets: Sequence, calls: int = GRAPH_CALLS) -> float:
        """Per-call time of a CUDA graph of ``calls`` back-to-back calls (median replay)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(3):
                fn(sets[i % len(sets)])
        torch.cuda.current_stream().wait_stream(side)
        _sync()
        g = torch.cuda.CUDAGraph()
        keep = []
        with torch.cuda.graph(g):
            for i in range(calls):
                keep.append(fn(sets[i % len(sets)]))
        g.replay()
        _sync()
        ts = []
        for _ in range(self.graph_replays):
            s, e = _event(), _event()
            s.record()
            g.replay()
            e.record()
            _sync()
            ts.append(s.elapsed_time(e) * 1e3 / calls)
        del g, keep
        return median(ts)

    def host_latency_samples(self, fn: Callable, inputs, blocks: int = 7) -> List[float]:
        """Wall clock around back-to-back eager calls with one sync at the end, per call: one
        sample a block of ``host_calls`` calls."""
        ts = []
        for _ in range(blocks):
            _sync()
            t0 = time.perf_counter()
            for _ in range(self.host_calls):
                fn(inputs)
            _sync()
            ts.append((time.perf_counter() - t0) / self.host_calls * 1e6)
        return ts

    # ------------------------------------------------------------------ the protocol

    def measure(self, fn: Callable, sets: Sequence, flush: bool, small: bool, samples: bool = False) -> dict:
        """Warm up, then time. Returns us (median), min_us, n, host_enqueue_us, with `samples`
        the device times themselves (_ts, and the host latency's per-block samples _host_ts) and,
        for small inputs, graph_us / host_us (or graph_error)."""
        _sync()
        t0 = time.perf_counter()
        for i in range(self.warmup):
            fn(sets[i % len(sets)])
        _sync()
        wall = (time.perf_counter() - t0) / max(self.warmup, 1)
        enq = self.host_enqueue_us(fn, sets, flush=flush)
        iters = self.iters
        if wall > 0:
            iters = int(min(self.iters, max(self.min_iters, self.budget_s / wall)))
        ts = self.device_times(fn, sets, iters, flush, enq)
        out = {}
        # Two modes in the samples (a clock or a neighbour changed under them): timed again, up
        # to UNSTEADY_RETIMES times, until one pass has a single mode; the first median is kept
        # beside the result. One retime left one H100 case of 151 in two modes
        # (bench/results/2026-12-05_h100_0e9703a/README.md).
        for _ in range(UNSTEADY_RETIMES):
            if median(ts) < UNSTEADY_RATIO * min(ts):
                break
            out.setdefault("retimed_from_us", median(ts))
            out["retimes"] = out.get("retimes", 0) + 1
            ts = self.device_times(fn, sets, iters, flush, enq)
        out.update({"us": median(ts), "min_us": min(ts), "n": len(ts),
                    "host_enqueue_us": round(enq, 2)})
        if samples:
            out["_ts"] = ts
        if small:
            host = self.host_latency_samples(fn, sets[0])
            out["host_us"] = median(host)
            if samples:
                out["_host_ts"] = host
            try:
                out["graph_us"] = self.graph_us(fn, sets)
            except Exception as e:  # noqa: BLE001
                out["graph_error"] = short_error(e)
                try:
                    _sync()
                except Exception:  # noqa: BLE001
                    pass
        return out

    # ------------------------------------------------------------------ calibration

    def calibrate(self) -> dict:
        """Copy bandwidth (which also brings the clocks up), the sleep rate, the empty launch."""
        out = self.copy_bandwidth()
        self.cycles_per_us = self._calibrate_sleep()
        self.flush()                       # allocate the flush buffer outside any timing
        torch.cuda.synchronize()
        out.update(self.empty_launch())
        out["l2_bytes"] = self.l2
        out["sleep_cycles_per_us"] = self.cycles_per_us
        return out

    def copy_bandwidth(self, nbytes: int = 1 << 30, reps: int = 20) -> dict:
        """Device-to-device copy of ``nbytes``: bytes read + written over the median time."""
        free, _total = torch.cuda.mem_get_info()
        nbytes = int(min(nbytes, free // 4))
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        ts = []
        for _ in range(reps):
            s, e = _event(), _event()
            s.record()
            dst.copy_(src)
            e.record()
            _sync()
            ts.append(s.elapsed_time(e) * 1e3)
        del src, dst
        torch.cuda.empty_cache()
        us = median(ts)
        return {"copy_bytes": 2 * nbytes, "copy_us": us, "copy_tbps": 2 * nbytes / us / 1e6}

    def empty_launch(self) -> dict:
        """The smallest kernel (1-element add_) timed three ways: as kernels are timed
        (events), in a CUDA graph, and host-inclusive eager."""
        x = torch.ones(1, device="cuda")

        def fn(_):
            return x.add_(1)

        m = self.measure(fn, [None], flush=False, small=True)
        return {"launch_us": m["us"], "launch_graph_us": m.get("graph_us"),
                "launch_host_us": m.get("host_us")}


def short_error(e: BaseException, limit: int = 300) -> str:
    msg = str(e).strip().splitlines()
    first = msg[0] if msg else ""
    text = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return text[:limit]
