"""What in the bench's eager run slows the next fusebox measurement of a decode-sized rms_norm?"""
import sys
import torch
import fusebox.bench.runner as R
from fusebox.bench import suite
from fusebox.bench.timing import Timer, median

case = suite.matching([sys.argv[1]], "bf16")[0]
runner = R.Runner(Timer(), use_compile=False, use_liger=True)
t = runner.timer
t.calibrate()
sets = [suite.build_inputs(case, "cuda", seed=0)]
fb, _ = runner.impl("fusebox", case)
eager, _ = runner.impl("eager", case)
lig, _ = runner.impl("liger", case)
tor, _ = runner.impl("torch", case)


def fb_us():
    with torch.no_grad():
        return t.measure(fb, sets, True, False)["us"]


def eager_full():
    with torch.no_grad():
        t.measure(eager, sets, True, True)


def eager_nosmall():
    with torch.no_grad():
        t.measure(eager, sets, True, False)


def eager_graph():
    with torch.no_grad():
        t.graph_us(eager, sets)


def eager_host():
    with torch.no_grad():
        t.host_latency_us(eager, sets[0])


def fb_graph():
    with torch.no_grad():
        t.graph_us(fb, sets)


def liger_full():
    with torch.no_grad():
        t.measure(lig, sets, True, True)


def torch_full():
    with torch.no_grad():
        t.measure(tor, sets, True, True)


steps = [("nothing", lambda: None), ("eager full", eager_full), ("eager no graph/host", eager_nosmall),
         ("eager graph only", eager_graph), ("eager host only", eager_host), ("fusebox graph", fb_graph),
         ("liger full", liger_full), ("torch full", torch_full)]
res = {n: [] for n, _ in steps}
for rnd in range(3):
    for n, f in steps:
        f()
        torch.cuda.synchronize()
        res[n].append(fb_us())
        # and a second fusebox measurement right after, without anything between
        res.setdefault(n + " (then again)", []).append(fb_us())
print(case.key)
for n, v in res.items():
    print(f"{n:34s} " + " ".join(f"{x:.2f}" for x in v))
