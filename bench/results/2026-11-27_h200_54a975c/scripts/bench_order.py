"""Does the bench's run order move decode-sized timings? Runs the bench's own run_case on a few
cases with the default order and with fusebox moved last, alternating, printing us per impl."""
import sys
import torch
import fusebox.bench.runner as R
from fusebox.bench import suite
from fusebox.bench.timing import Timer

cases = [c for c in suite.matching(sys.argv[1].split(","), "bf16")]
runner = R.Runner(Timer(), use_compile=True, use_liger=True)
runner.timer.calibrate()
orders = {"default": ("eager", "fusebox", "torch", "compile", "liger"),
          "fb_last": ("eager", "torch", "compile", "liger", "fusebox")}
for rnd in range(2):
    for oname, order in orders.items():
        R.RUN_ORDER = order
        for c in cases:
            rec = runner.run_case(c, impls=order)
            im = rec["impls"]
            row = " ".join(f"{k[:3]}={im[k]['us']:.2f}" for k in ("fusebox", "torch", "compile", "liger") if k in im and "us" in im[k])
            print(f"{rnd} {oname:8s} {c.key[:36]:36s} {row}", flush=True)
