"""Host cost of the patch helpers' checks on one CPU thread: the broadcast check and `fusable`
as they were at 587cec4 (torch.broadcast_shapes, generator expressions) and as d4616d6 has
them, on the operands of a PixArt-Sigma block's calls. Mean of 20000 calls."""
import timeit

import torch

from fusebox.patch._common import needs_autograd
from fusebox.patch.dit import _shared as S

torch.set_num_threads(1)


def fusable_587cec4(x, *small, like_x=()):
    if needs_autograd(x, *small, *like_x):
        return False
    if x.dtype not in S.FUSED_DTYPES or x.device.type not in S.FUSED_DEVICES:
        return False
    if not all(t is None or (t.device == x.device and t.dtype in (torch.float32, x.dtype)
                             and S.has_contiguous_rows(t)) for t in small):
        return False
    return all(t is None or (t.device == x.device and t.dtype == x.dtype) for t in like_x)


x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
s = torch.randn(2, 1, 64, dtype=torch.bfloat16)
table = torch.randn(1, 6, 64, dtype=torch.bfloat16)
emb = torch.randn(2, 6, 64, dtype=torch.bfloat16)
cases = [
    ("broadcast check, 587cec4", lambda: torch.broadcast_shapes(table.shape, emb.shape) == emb.shape),
    ("broadcast check, d4616d6", lambda: S.broadcasts_to(table, emb)),
    ("fusable(x, scale, shift, None, None), 587cec4", lambda: fusable_587cec4(x, s, s, None, None)),
    ("fusable(x, scale, shift, None, None), d4616d6", lambda: S.fusable(x, s, s, None, None)),
    ("fusable(x, like_x=(branch, gate)), 587cec4", lambda: fusable_587cec4(x, like_x=(x, s))),
    ("fusable(x, like_x=(branch, gate)), d4616d6", lambda: S.fusable(x, like_x=(x, s))),
]
with torch.inference_mode():
    for name, fn in cases:
        assert fn()
        n = 20000
        print(f"{name:48s} {timeit.timeit(fn, number=n) / n * 1e6:6.2f} us")
