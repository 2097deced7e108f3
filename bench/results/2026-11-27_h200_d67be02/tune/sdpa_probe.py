"""SDPA with a sliding-window bool mask and GQA (Gemma3-4B's local layers at 2048 tokens):
which kernels run and how long, for the ways a patched attention could call it."""
import torch, torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity
torch.manual_seed(0)
dev = "cuda"; B, H, HKV, S, D, W = 1, 8, 4, 2048, 256, 1024
q = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
k = torch.randn(B, S, HKV, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
v = torch.randn(B, S, HKV, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
i = torch.arange(S, device=dev)
mask = ((i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < W))[None, None]
fmask = torch.zeros(mask.shape, device=dev, dtype=torch.bfloat16).masked_fill(~mask, float("-inf"))
def rep(t): return t[:, :, None].expand(B, HKV, H // HKV, S, D).reshape(B, H, S, D)
cases = {
    "repeat_kv + bool mask (transformers)": lambda: F.scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=mask, scale=D ** -0.5),
    "repeat_kv + bf16 additive mask": lambda: F.scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=fmask, scale=D ** -0.5),
    "enable_gqa + bool mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D ** -0.5, enable_gqa=True),
    "enable_gqa + bf16 additive mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=fmask, scale=D ** -0.5, enable_gqa=True),
    "repeat_kv contiguous + bf16 additive mask": lambda: F.scaled_dot_product_attention(q, rep(k).contiguous(), rep(v).contiguous(), attn_mask=fmask, scale=D ** -0.5),
}
ref = None
for name, fn in cases.items():
    try:
        out = fn(); torch.cuda.synchronize()
    except Exception as e:
        print(f"{name}: fails: {str(e)[:200]}"); continue
    r = out.double()
    if ref is None: ref = r
    err = ((r - ref).norm() / ref.norm()).item()
    for _ in range(5): fn()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(20):
        st.record(); fn(); en.record(); torch.cuda.synchronize(); ts.append(st.elapsed_time(en) * 1e3)
    ts.sort()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn(); torch.cuda.synchronize()
    ks = [(e.name[:70], round(e.device_time, 1)) for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"{name}: median {ts[10]:.1f} us, rel diff vs first {err:.2e}")
    for kname, t in ks: print(f"      {t:8.1f} us  {kname}")
