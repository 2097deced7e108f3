"""Instruction mix per kernel from Nsight Compute's SASS source page: how many warp-level
instructions of each opcode a kernel executed, and the share of stall samples on them. Shows
where an instruction-bound kernel spends its issue slots (row setup, address arithmetic,
branches) beside its math.

    ncu --section SourceCounters -o rep python scripts/ncu_cases.py --cases ... --impls fusebox
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python scripts/ncu_mix.py sass.csv [--top 25] [--per N]

``--per N`` also divides the counts by N (rows or warps), e.g. instructions per warp-row.
"""

from __future__ import annotations

import argparse
import collections
import csv


def kernels(path):
    """(name, header, rows) of each kernel of the CSV, in order (ncu repeats a kernel's page for
    each profiled call)."""
    out, cur = [], None
    for row in csv.reader(open(path, newline="")):
        if row and row[0] == "Kernel Name":
            cur = {"name": row[1], "header": None, "rows": []}
            out.append(cur)
        elif row and row[0] == "Address" and cur is not None:
            cur["header"] = row
        elif row and cur is not None:
            cur["rows"].append(row)
    return out


def mix(kernel):
    h = kernel["header"]
    executed, stalls = h.index("Instructions Executed"), h.index("Warp Stall Sampling (All Samples)")
    counts, stalled = collections.Counter(), collections.Counter()
    for row in kernel["rows"]:
        try:
            n = int(row[executed].replace(",", "") or 0)
        except ValueError:
            continue
        words = row[1].split()
        if not words:
            continue
        op = (words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).split(".")[0]
        counts[op] += n
        stalled[op] += int(row[stalls] or 0)
    return counts, stalled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--per", type=float, default=0, help="also print counts divided by this")
    args = ap.parse_args()
    seen = set()
    for kernel in kernels(args.csv):
        if kernel["name"] in seen or kernel["header"] is None:
            continue
        seen.add(kernel["name"])
        counts, stalled = mix(kernel)
        total, total_stalls = sum(counts.values()), max(1, sum(stalled.values()))
        print(kernel["name"])
        print(f"  executed warp instructions: {total:,}")
        for op, n in counts.most_common(args.top):
            per = f"  {n / args.per:10.1f} per unit" if args.per else ""
            print(f"  {op:10s} {n:14,d} {100 * n / total:5.1f}%  stall samples {100 * stalled[op] / total_stalls:5.1f}%{per}")
        print()


if __name__ == "__main__":
    main()
