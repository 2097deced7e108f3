"""The benchmark suite: one registry of ops.

Each :class:`OpSpec` says which shapes to run (``shapes()``: group, label, params, in --quick?),
how to build one input set (``build``), the fewest bytes the op must move (``nbytes``: each
input read once, each output written once, broadcast operands and tables at their real size),
and the implementations: ``fusebox`` (takes the ``fusebox.functional`` module), ``eager`` (the
HF/diffusers code), ``torch`` (the fused PyTorch op where one exists), ``liger`` (takes
``liger_kernel.transformers.functional``). ``torch.compile`` of ``eager`` is made by the runner.

Every implementation is ``f(t, p)`` (or ``f(mod, t, p)``): ``t`` the dict of tensors from
``build``, ``p`` the case's params; all return outputs in the same logical layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from . import baselines as B

GROUPS = ("llm", "seeds", "dit")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
                 "half": "fp16", "fp32": "fp32", "float32": "fp32", "float": "fp32"}

# ---- shapes of the default suite (issue 3)
LLM_ROWS = (1, 16, 256, 2048, 8192, 32768)
LLM_WIDTHS = (2048, 3072, 4096)
FFN_ROWS = (1, 16, 256, 2048, 8192)
FFN_WIDTHS = (11008, 12288, 14336)          # Llama-2-7B, Qwen3-8B, Llama-3-8B/Mistral-7B
GEMMA_FFN_ROWS = (1, 16, 2048, 8192)
GEMMA_FFN_WIDTHS = (10240, 21504)           # Gemma3 4B, 27B
LN_LLM_ROWS = (1, 16, 2048, 8192)
LN_LLM_WIDTHS = (2560, 3072)                # Phi-2 / Pythia-2.8B, StarCoder2-3B
ROPE_TOKENS = (1, 16, 256, 2048, 8192)
SEEDS_LTX = ((1, 1024, 2048), (2, 1024, 2048), (4, 1024, 2048), (1, 4096, 2048),
             (2, 4096, 3072), (1, 8192, 2048), (4, 4096, 3072))
SEEDS_QWEN = ((1, 128, 4096), (1, 512, 4096), (1, 1024, 4096), (1, 2048, 4096),
              (1, 4096, 4096), (4, 512, 4096), (8, 256, 4096), (1, 8192, 4096))
# name: (B, S, D, norm, fp32 modulation, ffn width)
DIT = {
    "ltx": ((2, 2688, 2048), "rms", False, 8192),
    "ltx-long": ((2, 8064, 2048), "rms", False, 8192),
    "flux": ((1, 4608, 3072), "layer", False, 12288),
    "wan1.3b": ((1, 32760, 1536), "layer", True, 8960),
    "wan14b": ((1, 32760, 5120), "layer", True, 13824),
}
WAN_GRID = (21, 30, 52)                     # 81x480x832 latent grid, 32760 tokens


def _esize(dt) -> int:
    return torch.empty((), dtype=dt).element_size()


def _numel(shape: Sequence[int]) -> int:
    return int(math.prod(shape))


def _dims(shape: Sequence[int]) -> str:
    return "x".join(str(s) for s in shape)


@dataclass(frozen=True)
class OpSpec:
    name: str
    title: str
    shapes: Callable[[], List[Tuple[str, str, dict, bool]]]
    build: Callable[[dict, torch.dtype, object, object], Dict[str, torch.Tensor]]
    nbytes: Callable[[dict, torch.dtype], int]
    fusebox: Callable
    eager: Callable
    eager_doc: str
    torch: Optional[Callable] = None
    torch_doc: str = ""
    liger: Optional[Callable] = None
    liger_doc: str = ""
    reads: Tuple[str, ...] = field(default=())   # the tensors of ``build`` fusebox reads


@dataclass(frozen=True)
class Case:
    op: str
    group: str
    label: str
    params: dict
    dtype: str

    @property
    def key(self) -> str:
        return f"{self.op}|{self.label}|{self.dtype}"

    @property
    def spec(self) -> OpSpec:
        return REGISTRY[self.op]

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes(self.params, DTYPES[self.dtype])


class _Rand:
    """Fresh random tensors (never zeros) from one seeded generator."""

    def __init__(self, device, seed: int = 0):
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(seed)

    def __call__(self, shape, dtype, scale: float = 1.0, offset: float = 0.0):
        t = torch.randn(tuple(shape), generator=self.gen, device=self.device, dtype=torch.float32)
        if scale != 1.0 or offset != 0.0:
            t = t * scale + offset
        return t.to(dtype)


def _mod_table(r: _Rand, b: int, t: int, d: int, dtype):
    """A ``[B, T, 6, D]`` modulation table; chunks are strided ``[B, T, D]`` views, as
    ``(table + temb).unbind(2)`` / ``chunk(6)`` give them to the blocks."""
    return r((b, t, 6, d), dtype, scale=0.1)


# =========================================================================== rms_norm


def _rms_shapes():
    out = []
    for rows in LLM_ROWS:
        for d in LLM_WIDTHS:
            out.append(("llm", f"{rows}x{d}", dict(shape=(rows, d), weight=True, eps=1e-6),
                        (rows, d) in ((1, 4096), (2048, 4096))))
    for s in SEEDS_QWEN:
        out.append(("seeds", f"[{_dims(s)}]", dict(shape=s, weight=True, eps=1e-6), False))
    for s in SEEDS_LTX:
        out.append(("seeds", f"[{_dims(s)}] no-w", dict(shape=s, weight=False, eps=1e-6), False))
    for name in ("ltx", "ltx-long"):
        s = DIT[name][0]
        out.append(("dit", f"{name} {_dims(s)} no-w", dict(shape=s, weight=False, eps=1e-6),
                    name == "ltx"))
    return out


def _rms_build(p, dt, dev, r):
    d = p["shape"][-1]
    t = {"x": r(p["shape"], dt)}
    t["w"] = r((d,), dt, 0.1, 1.0) if p["weight"] else None
    return t


def _rms_bytes(p, dt):
    e, d = _esize(dt), p["shape"][-1]
    return 2 * _numel(p["shape"]) * e + (d * e if p["weight"] else 0)


def _rms_eager(t, p):
    if t["w"] is None:
        return B.diffusers_rms_norm(t["x"], p["eps"])
    return B.llama_rms_norm(t["x"], t["w"], p["eps"])


# =========================================================================== fused_add_rms_norm


def _add_rms_shapes():
    out = []
    for rows in LLM_ROWS:
        for d in LLM_WIDTHS:
            out.append(("llm", f"{rows}x{d}", dict(shape=(rows, d), eps=1e-6),
                        (rows, d) in ((16, 4096), (2048, 4096))))
    for s in SEEDS_QWEN:
        out.append(("seeds", f"[{_dims(s)}]", dict(shape=s, eps=1e-6), False))
    return out


def _add_rms_build(p, dt, dev, r):
    d = p["shape"][-1]
    return {"x": r(p["shape"], dt), "residual": r(p["shape"], dt), "w": r((d,), dt, 0.1, 1.0)}


def _add_rms_bytes(p, dt):
    e, d = _esize(dt), p["shape"][-1]
    return 4 * _numel(p["shape"]) * e + d * e


def _add_rms_eager(t, p):
    h = t["x"] + t["residual"]
    return B.llama_rms_norm(h, t["w"], p["eps"]), h


def _add_rms_torch(t, p):
    h = t["x"] + t["residual"]
    return F.rms_norm(h, (h.shape[-1],), t["w"], p["eps"]), h


# =========================================================================== rms_norm_add


def _norm_add_shapes():
    # post-norm residual adds at prefill: Gemma3-4B (2560 wide), OLMo-2 7B (4096)
    return [("llm", f"{rows}x{d}", dict(shape=(rows, d), eps=1e-6), (rows, d) == (2048, 4096))
            for d in (2560, 4096) for rows in (2048, 8192)]


def _norm_add_bytes(p, dt):
    e, d = _esize(dt), p["shape"][-1]
    return 3 * _numel(p["shape"]) * e + d * e


# =========================================================================== layer_norm


def _ln_shapes():
    out = [("llm", f"{rows}x{d}", dict(shape=(rows, d), eps=1e-5, fp32=False),
            (rows, d) in ((1, 2560), (2048, 2560)))
           for rows in LN_LLM_ROWS for d in LN_LLM_WIDTHS]
    for name, (s, _norm, fp32, _f) in DIT.items():
        out.append(("dit", f"{name} {_dims(s)}", dict(shape=s, eps=1e-6, fp32=fp32),
                    name == "flux"))
    return out


def _ln_build(p, dt, dev, r):
    d = p["shape"][-1]
    wdt = torch.float32 if p["fp32"] else dt      # Wan keeps its norms in fp32
    t = {"x": r(p["shape"], dt), "w": r((d,), wdt, 0.1, 1.0), "b": r((d,), wdt, 0.1)}
    t["w_lp"], t["b_lp"] = t["w"].to(dt), t["b"].to(dt)   # for F.layer_norm in x's dtype
    return t


def _ln_bytes(p, dt):
    d = p["shape"][-1]
    wdt = torch.float32 if p["fp32"] else dt
    return 2 * _numel(p["shape"]) * _esize(dt) + 2 * d * _esize(wdt)


def _ln_eager(t, p):
    if p["fp32"]:
        return B.layer_norm_fp32(t["x"], p["eps"], t["w"], t["b"])
    return B.layer_norm_nn(t["x"], p["eps"], t["w"], t["b"])


def _ln_torch(t, p):
    if not p["fp32"]:
        raise NotImplementedError("eager is already F.layer_norm")
    return F.layer_norm(t["x"], (t["x"].shape[-1],), t["w_lp"], t["b_lp"], p["eps"])


# =========================================================================== adaln & friends


def _adaln_shapes():
    out = []
    for name, (s, norm, fp32, _f) in DIT.items():
        tokens = (1, s[1]) if name in ("ltx", "ltx-long", "wan1.3b", "wan14b") else (1,)
        for t in tokens:
            mod = "sample" if t == 1 else "token"
            out.append(("dit", f"{name} {_dims(s)} {norm} {mod}",
                        dict(shape=s, norm=norm, T=t, fp32=fp32, eps=1e-6),
                        (name, t) in (("ltx", 1), ("wan14b", 1))))
    return out


def _gr_shapes():
    out = []
    for name, (s, _norm, fp32, _f) in DIT.items():
        out.append(("dit", f"{name} {_dims(s)}", dict(shape=s, T=1, fp32=fp32), name == "ltx"))
    return out


def _grn_shapes():
    out = []
    for name, (s, norm, fp32, _f) in DIT.items():
        out.append(("dit", f"{name} {_dims(s)} {norm}",
                    dict(shape=s, norm=norm, T=1, fp32=fp32, eps=1e-6), name == "ltx"))
    s = DIT["ltx"][0]
    out.append(("dit", f"ltx {_dims(s)} rms token",
                dict(shape=s, norm="rms", T=s[1], fp32=False, eps=1e-6), False))
    return out


def _mod_build(p, dt, dev, r, need_branch):
    b, s, d = p["shape"]
    mdt = torch.float32 if p["fp32"] else dt
    table = _mod_table(r, b, p["T"], d, mdt)
    t = {"x": r(p["shape"], dt), "shift": table[:, :, 0], "scale": table[:, :, 1],
         "gate": table[:, :, 2]}
    if need_branch:
        t["branch"] = r(p["shape"], dt)
    return t


def _mod_bytes(p, dt, big_in, big_out, mods):
    b, s, d = p["shape"]
    mdt = torch.float32 if p["fp32"] else dt
    return ((big_in + big_out) * _numel(p["shape"]) * _esize(dt)
            + mods * b * p["T"] * d * _esize(mdt))


def _adaln_eager(t, p):
    return B.adaln_eager(t["x"], t["scale"], t["shift"], p["norm"], p["eps"], p["fp32"])


def _adaln_torch(t, p):
    if p["norm"] != "rms" or p["fp32"]:
        raise NotImplementedError("no fused PyTorch op beyond what eager already uses")
    x = t["x"]
    return B.modulate(F.rms_norm(x, (x.shape[-1],), None, p["eps"]), t["scale"], t["shift"])


def _adaln_liger(lk, t, p):
    if p["norm"] != "rms" or p["fp32"]:
        raise NotImplementedError("Liger has a modulated RMSNorm only")
    return lk.liger_modulated_rms_norm(t["x"], None, t["scale"], t["shift"], p["eps"])


def _grn_eager(t, p):
    h = B.gated_residual_eager(t["x"], t["branch"], t["gate"], p["fp32"])
    return B.adaln_eager(h, t["scale"], t["shift"], p["norm"], p["eps"], p["fp32"]), h


def _grn_torch(t, p):
    if p["norm"] != "rms" or p["fp32"]:
        raise NotImplementedError("no fused PyTorch op beyond what eager already uses")
    h = t["x"] + t["branch"] * t["gate"]
    return B.modulate(F.rms_norm(h, (h.shape[-1],), None, p["eps"]), t["scale"], t["shift"]), h


# =========================================================================== activations


def _gelu_shapes():
    out = []
    for name, (s, _n, _fp32, ffn) in DIT.items():
        shp = (s[0], s[1], ffn)
        out.append(("dit", f"{name} {_dims(shp)}", dict(shape=shp), name == "ltx"))
    return out


def _gelu_build(p, dt, dev, r):
    return {"x": r(p["shape"], dt), "bias": r((p["shape"][-1],), dt, 0.1)}


def _gelu_bytes(p, dt):
    e = _esize(dt)
    return 2 * _numel(p["shape"]) * e + p["shape"][-1] * e


def _glu_shapes(rows, widths, quick):
    return [("llm", f"{m}x{n}", dict(shape=(m, n)), (m, n) in quick)
            for m in rows for n in widths]


def _glu_build(p, dt, dev, r):
    return {"gate": r(p["shape"], dt), "up": r(p["shape"], dt)}


def _glu_bytes(p, dt):
    return 3 * _numel(p["shape"]) * _esize(dt)


# =========================================================================== mixture of experts

# (tokens, top_k, hidden): DeepSeek-V2-Lite (6 of 64 experts), OLMoE / Qwen3-30B-A3B (8 of 64 /
# 128), Mixtral 8x7B (2 of 8), DeepSeek-V3 (8 of 256, 7168 wide)
MOE_COMBINE = (("deepseek-v2-lite", 6, 2048), ("olmoe", 8, 2048), ("mixtral", 2, 4096),
               ("deepseek-v3", 8, 7168))
MOE_TOKENS = (1, 16, 2048, 8192)


def _moe_shapes():
    return [("llm", f"{name} {n}x{k}x{h}", dict(tokens=n, top_k=k, hidden=h),
             (name, n) in (("deepseek-v2-lite", 2048), ("olmoe", 16)))
            for name, k, h in MOE_COMBINE for n in MOE_TOKENS]


def _moe_build(p, dt, dev, r):
    n, k = p["tokens"], p["top_k"]
    index = torch.randperm(n * k, generator=r.gen, device=dev)
    weights = torch.rand((n, k), generator=r.gen, device=dev) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    sorted_weights = torch.empty(n * k, device=dev)
    sorted_weights[index] = weights.view(-1)   # the weights in the rows' (expert-sorted) order
    return {"rows": r((n * k, p["hidden"]), dt), "index": index.view(n, k), "weights": weights,
            "sorted_weights": sorted_weights}


def _moe_bytes(p, dt):
    n, k, h = p["tokens"], p["top_k"], p["hidden"]
    return (n * k + n) * h * _esize(dt) + n * k * (8 + 4)


def _moe_eager(t, p):
    """transformers' grouped experts: the sorted rows weighted in fp32, put back in token order,
    each token's rows summed, the sum cast to the model's dtype."""
    n, k, h = p["tokens"], p["top_k"], p["hidden"]
    weighted = t["rows"] * t["sorted_weights"].unsqueeze(-1)
    return weighted[t["index"].view(-1)].view(n, k, h).sum(dim=1).to(t["rows"].dtype)


# The routers after their GEMM: (model, experts, top_k, form). DeepSeek-V2-Lite's and
# DeepSeek-V3's logits are fp32 (their routers cast before the GEMM); OLMoE's and Qwen3-MoE's
# weights are cast to the logits' dtype, Mixtral's and the DeepSeeks' stay fp32.
_ROUTER_FORMS = {
    "greedy": dict(score="softmax", renormalize=False, scale=1.0, fp32_logits=True, cast=False),
    "olmoe": dict(score="softmax", renormalize=False, scale=1.0, fp32_logits=False, cast=True),
    "mixtral": dict(score="softmax", renormalize=True, scale=1.0, fp32_logits=False, cast=False),
    "qwen3": dict(score="softmax", renormalize=True, scale=1.0, fp32_logits=False, cast=True),
    # sigmoid scores, the choice by score + bias within the 4 best of 8 groups, scale 2.5
    "noaux_tc": dict(score="sigmoid", groups=(8, 4), renormalize=True, scale=2.5, fp32_logits=True,
                     cast=False),
}
MOE_ROUTERS = (("deepseek-v2-lite", 64, 6, "greedy"), ("olmoe", 64, 8, "olmoe"),
               ("mixtral", 8, 2, "mixtral"), ("qwen3-30b-a3b", 128, 8, "qwen3"),
               ("deepseek-v3", 256, 8, "noaux_tc"))


def _router_shapes():
    return [("llm", f"{name} {n}x{e} top-{k}", dict(tokens=n, experts=e, top_k=k, **_ROUTER_FORMS[form]),
             (name, n) in (("olmoe", 2048), ("deepseek-v3", 16)))
            for name, e, k, form in MOE_ROUTERS for n in MOE_TOKENS]


def _router_build(p, dt, dev, r):
    """Each token's logits a shuffle of distinct values 8 / E apart in (-4, 4), distinct in
    16-bit dtypes too: no equal scores, whose order topk leaves open, so the experts compare
    element for element. The choice bias (sigmoid routers) of distinct multiples of 1/1024."""
    n, e = p["tokens"], p["experts"]
    ranks = torch.rand((n, e), generator=r.gen, device=dev).argsort(-1)
    logits = (ranks.float() - e / 2) * (8.0 / e)
    t = {"logits": logits.to(torch.float32 if p["fp32_logits"] else dt)}
    if p["score"] == "sigmoid":
        t["bias"] = (torch.randperm(e, generator=r.gen, device=dev).float() - e / 2) / 1024
    return t


def _router_bytes(p, dt):
    """Logits (and bias) read; weights (fp32 or the logits' dtype) and int64 experts written."""
    logits_size = 4 if p["fp32_logits"] else _esize(dt)
    weights_size = logits_size if p["cast"] else 4
    bias = 4 * p["experts"] if p["score"] == "sigmoid" else 0
    return p["tokens"] * (p["experts"] * logits_size + p["top_k"] * (weights_size + 8)) + bias


def _router_eager(t, p):
    """transformers' routers after the GEMM: softmax in fp32, topk, the optional
    renormalization, routing scale and cast; or DeepSeek-V3's sigmoid, bias and group-limited
    choice."""
    logits, k = t["logits"], p["top_k"]
    if p["score"] == "sigmoid":
        scores = logits.sigmoid()
        choice = scores + t["bias"]
        groups, topk_groups = p["groups"]
        group_scores = choice.view(-1, groups, p["experts"] // groups).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, groups, p["experts"] // groups).reshape(
            -1, p["experts"])
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        index = torch.topk(choice, k=k, dim=-1, sorted=True)[1]   # sorted: compares in order
        top = scores.gather(1, index)
        top /= top.sum(dim=-1, keepdim=True) + 1e-20
        return top * p["scale"], index
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    top, index = torch.topk(probs, k, dim=-1)
    if p["renormalize"]:
        top /= top.sum(dim=-1, keepdim=True)
    if p["scale"] != 1.0:
        top = top * p["scale"]
    return (top.to(logits.dtype) if p["cast"] else top), index


def _router_fusebox(fb, t, p):
    logits = t["logits"]
    groups, topk_groups = p.get("groups", (1, 1))
    return fb.moe_topk(logits, p["top_k"], p["score"], t.get("bias"), groups, topk_groups,
                       p["renormalize"], p["scale"], logits.dtype if p["cast"] else torch.float32)


# (top_k, experts) of the routers whose (token, k) pairs moe_sort orders: the same models
MOE_SORT = (("deepseek-v2-lite", 6, 64), ("olmoe", 8, 64), ("mixtral", 2, 8), ("deepseek-v3", 8, 256))


def _moe_sort_shapes():
    return [("llm", f"{name} {n}x{k} of {e}", dict(tokens=n, top_k=k, experts=e),
             (name, n) in (("deepseek-v2-lite", 2048), ("olmoe", 16)))
            for name, k, e in MOE_SORT for n in MOE_TOKENS]


def _moe_sort_build(p, dt, dev, r):
    """Each token's top-k of distinct experts, as a router picks them (int64, as topk gives)."""
    scores = torch.rand((p["tokens"], p["experts"]), generator=r.gen, device=dev)
    return {"index": scores.argsort(-1)[:, :p["top_k"]].contiguous()}


def _moe_sort_bytes(p, dt):
    """The int64 index read; row_token, offsets and pair_row written (int32, as moe_sort writes
    them; the unfused form writes two of them as int64)."""
    pairs = p["tokens"] * p["top_k"]
    return pairs * 8 + (2 * pairs + p["experts"]) * 4


def _moe_sort_eager(t, p):
    """transformers' grouped experts: the pairs sorted by expert, the rows' tokens, the experts'
    offsets from a histogram, the inverse permutation by index_put."""
    k, e = p["top_k"], p["experts"]
    expert_ids = t["index"].reshape(-1)
    _, perm = torch.sort(expert_ids, stable=True)   # stable: outputs compare element for element
    counts_of = expert_ids.float() if expert_ids.device.type == "cpu" else expert_ids.int()
    offsets = torch.cumsum(torch.histc(counts_of, bins=e, min=0, max=e - 1), dim=0, dtype=torch.int32)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
    return perm // k, offsets, inv_perm.view(t["index"].shape)


# =========================================================================== rotary


def _rope_shapes():
    return [("llm", f"{s} tok 32+8x128", dict(B=1, S=s, hq=32, hk=8, d=128, theta=1e6),
             s in (1, 8192)) for s in ROPE_TOKENS]


def _rope_build(p, dt, dev, r):
    b, s, d = p["B"], p["S"], p["d"]
    cos, sin = B.half_split_table(b, s, d, p["theta"], dt, dev)
    return {"q": r((b, s, p["hq"], d), dt), "k": r((b, s, p["hk"], d), dt), "cos": cos,
            "sin": sin}


def _qk_bytes(p, dt):
    """q and k read and written once."""
    e = _esize(dt)
    if "W" in p:        # flat [B, S, W]
        return 2 * 2 * p["B"] * p["S"] * p["W"] * e
    return 2 * p["B"] * p["S"] * (p["hq"] + p["hk"]) * p["d"] * e


def _rope_bytes(p, dt):
    return _qk_bytes(p, dt) + 2 * p["B"] * p["S"] * p["d"] * _esize(dt)


def _rope_eager(t, p):
    q, k = t["q"].transpose(1, 2), t["k"].transpose(1, 2)      # as HF has them: [B, H, S, D]
    qo, ko = B.hf_apply_rotary_pos_emb(q, k, t["cos"], t["sin"])
    return qo.transpose(1, 2), ko.transpose(1, 2)


def _irope_shapes():
    b, s, d = DIT["flux"][0]
    out = [("dit", f"flux {b}x{s}x24x128 tab[S,128]",
            dict(kind="flux", B=b, S=s, hq=24, hk=24, d=128), True)]
    for name in ("ltx", "ltx-long"):
        b, s, w = DIT[name][0]
        out.append(("dit", f"{name} flat {b}x{s}x{w} tab[B,S,{w}]",
                    dict(kind="ltx", B=b, S=s, W=w), False))
    return out


def _irope_build(p, dt, dev, r):
    if p["kind"] == "ltx":
        shp = (p["B"], p["S"], p["W"])
        cos, sin = B.random_pair_table(shp, dev, r.gen)
        return {"q": r(shp, dt), "k": r(shp, dt), "cos": cos, "sin": sin}
    cos, sin = B.flux_table(p["S"], dev)
    return {"q": r((p["B"], p["S"], p["hq"], p["d"]), dt),
            "k": r((p["B"], p["S"], p["hk"], p["d"]), dt), "cos": cos, "sin": sin}


def _table_bytes(p):
    """fp32 cos + sin tables at their real size."""
    if p["kind"] == "ltx":
        return 2 * p["B"] * p["S"] * p["W"] * 4
    return 2 * p["S"] * p["d"] * 4


def _irope_bytes(p, dt):
    return _qk_bytes(p, dt) + _table_bytes(p)


def _irope_eager(t, p):
    return (B.diffusers_apply_rotary_emb(t["q"], t["cos"], t["sin"]),
            B.diffusers_apply_rotary_emb(t["k"], t["cos"], t["sin"]))


def _rope3d_shapes():
    f, h, w = WAN_GRID
    return [("dit", f"wan {f}x{h}x{w} {hd}x128",
             dict(B=1, S=f * h * w, grid=(f, h, w), hq=hd, hk=hd, d=128), hd == 12)
            for hd in (12, 40)]


def _rope3d_build(p, dt, dev, r):
    d = p["d"]
    pos = B.video_positions(*p["grid"], dev)
    cos, sin = B.axes_table(pos, B.wan_axes_dim(d), 10000.0)
    return {"q": r((p["B"], p["S"], p["hq"], d), dt), "k": r((p["B"], p["S"], p["hk"], d), dt),
            "freqs_cos": cos[None, :, None, :], "freqs_sin": sin[None, :, None, :]}


def _rope3d_eager(t, p):
    """Wan's rotary with its precomputed ``[1, S, 1, 128]`` fp32 table (built once per forward
    in the model, so outside the timing)."""
    return (B.wan_apply_rotary_emb(t["q"], t["freqs_cos"], t["freqs_sin"]),
            B.wan_apply_rotary_emb(t["k"], t["freqs_cos"], t["freqs_sin"]))


def _qknr_shapes():
    out = [("llm", f"qwen3 {s} tok 32+8x128",
            dict(kind="qwen3", B=1, S=s, hq=32, hk=8, d=128, eps=1e-6, theta=1e6),
            s == 2048) for s in ROPE_TOKENS]
    out += [("llm", f"olmo2 {s} tok 32+32x128 across",
             dict(kind="olmo2", B=1, S=s, hq=32, hk=32, d=128, eps=1e-6, theta=5e5), s == 1)
            for s in ROPE_TOKENS]
    b, s, _ = DIT["flux"][0]
    out.append(("dit", f"flux {b}x{s}x24x128", dict(kind="flux", B=b, S=s, hq=24, hk=24,
                                                     d=128, eps=1e-6), False))
    for name in ("ltx", "ltx-long"):
        b, s, w = DIT[name][0]
        out.append(("dit", f"{name} flat {b}x{s}x{w} across", dict(kind="ltx", B=b, S=s, W=w,
                                                                   eps=1e-5), name == "ltx"))
    for name, heads in (("wan1.3b", 12), ("wan14b", 40)):
        b, s, w = DIT[name][0]
        out.append(("dit", f"{name} {b}x{s}x{heads}x128 across",
                    dict(kind="wan", B=b, S=s, hq=heads, hk=heads, d=128, eps=1e-6), False))
    return out


def _qknr_build(p, dt, dev, r):
    kind = p["kind"]
    if kind == "qwen3":
        t = _rope_build(p, dt, dev, r)
        t["qw"], t["kw"] = r((p["d"],), dt, 0.1, 1.0), r((p["d"],), dt, 0.1, 1.0)
        return t
    if kind == "olmo2":     # its rotary tables stay fp32
        b, s, d = p["B"], p["S"], p["d"]
        cos, sin = B.half_split_table(b, s, d, p["theta"], torch.float32, dev)
        width = p["hq"] * d
        return {"q": r((b, s, p["hq"], d), dt), "k": r((b, s, p["hk"], d), dt), "cos": cos,
                "sin": sin, "qw": r((width,), dt, 0.1, 1.0), "kw": r((width,), dt, 0.1, 1.0)}
    if kind == "ltx":
        t = _irope_build(p, dt, dev, r)
        t["qw"], t["kw"] = r((p["W"],), dt, 0.1, 1.0), r((p["W"],), dt, 0.1, 1.0)
        return t
    if kind == "flux":
        t = _irope_build(p, dt, dev, r)
        t["qw"], t["kw"] = r((p["d"],), dt, 0.1, 1.0), r((p["d"],), dt, 0.1, 1.0)
        return t
    # wan: q/k projections [B, S, H*D], norm across heads, table [S, 128]
    b, s, h, d = p["B"], p["S"], p["hq"], p["d"]
    pos = B.video_positions(*WAN_GRID, dev)
    cos, sin = B.axes_table(pos, B.wan_axes_dim(d), 10000.0)
    return {"q": r((b, s, h * d), dt), "k": r((b, s, h * d), dt), "cos": cos[:s], "sin": sin[:s],
            "qw": r((h * d,), dt, 0.1, 1.0), "kw": r((h * d,), dt, 0.1, 1.0)}


def _qknr_bytes(p, dt):
    e = _esize(dt)
    kind = p["kind"]
    if kind == "qwen3":
        return _rope_bytes(p, dt) + 2 * p["d"] * e
    if kind == "olmo2":
        return _qk_bytes(p, dt) + 2 * p["B"] * p["S"] * p["d"] * 4 + 2 * p["hq"] * p["d"] * e
    if kind == "ltx":
        return _irope_bytes(p, dt) + 2 * p["W"] * e
    if kind == "flux":
        return _irope_bytes(p, dt) + 2 * p["d"] * e
    return _qk_bytes(p, dt) + 2 * p["S"] * p["d"] * 4 + 2 * p["hq"] * p["d"] * e


def _qknr_eager(t, p):
    kind, eps = p["kind"], p["eps"]
    q, k = t["q"], t["k"]
    if kind == "qwen3":     # Qwen3Attention: q_norm on [B,S,H,D], transpose, rotate_half rope
        qn = B.llama_rms_norm(q, t["qw"], eps).transpose(1, 2)
        kn = B.llama_rms_norm(k, t["kw"], eps).transpose(1, 2)
        qo, ko = B.hf_apply_rotary_pos_emb(qn, kn, t["cos"], t["sin"])
        return qo.transpose(1, 2), ko.transpose(1, 2)
    if kind == "olmo2":
        return _olmo2_qk_norm_rope(t, B.t5_rms_norm, eps)
    # nn.RMSNorm forward is F.rms_norm (per head for Flux, across heads for LTX/Wan)
    qn = F.rms_norm(q, (q.shape[-1],), t["qw"], eps)
    kn = F.rms_norm(k, (k.shape[-1],), t["kw"], eps)
    if kind == "wan":       # WanAttnProcessor: unflatten heads, then rotary with [1,S,1,D]
        h = p["hq"]
        qn, kn = qn.unflatten(2, (h, -1)), kn.unflatten(2, (h, -1))
        fc, fs = t["cos"][None, :, None, :], t["sin"][None, :, None, :]
        return B.wan_apply_rotary_emb(qn, fc, fs), B.wan_apply_rotary_emb(kn, fc, fs)
    return (B.diffusers_apply_rotary_emb(qn, t["cos"], t["sin"]),
            B.diffusers_apply_rotary_emb(kn, t["cos"], t["sin"]))


def _olmo2_qk_norm_rope(t, norm, eps):
    """Olmo2Attention: q_norm/k_norm over all heads of the projection, then rotate_half rope
    with fp32 tables (the math in fp32), cast back."""
    q, k = t["q"], t["k"]
    qn = norm(q.flatten(2), t["qw"], eps).view(q.shape).transpose(1, 2)
    kn = norm(k.flatten(2), t["kw"], eps).view(k.shape).transpose(1, 2)
    qo, ko = B.hf_apply_rotary_pos_emb(qn, kn, t["cos"], t["sin"])
    return qo.to(q.dtype).transpose(1, 2), ko.to(k.dtype).transpose(1, 2)


def _qknr_torch(t, p):
    if p["kind"] == "olmo2":
        return _olmo2_qk_norm_rope(
            t, lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps), p["eps"])
    if p["kind"] != "qwen3":
        raise NotImplementedError("eager already uses F.rms_norm")
    eps = p["eps"]
    d = p["d"]
    qn = F.rms_norm(t["q"], (d,), t["qw"], eps).transpose(1, 2)
    kn = F.rms_norm(t["k"], (d,), t["kw"], eps).transpose(1, 2)
    qo, ko = B.hf_apply_rotary_pos_emb(qn, kn, t["cos"], t["sin"])
    return qo.transpose(1, 2), ko.transpose(1, 2)


def _qknr_liger(lk, t, p):
    if p["kind"] != "qwen3":
        raise NotImplementedError("Liger has no interleaved rope")
    qn = lk.liger_rms_norm(t["q"], t["qw"], p["eps"])       # Liger-patched Qwen3: two launches
    kn = lk.liger_rms_norm(t["k"], t["kw"], p["eps"])
    return B.liger_rope_bshd(lk, qn, kn, t["cos"], t["sin"])


def _qknr_fusebox(fb, t, p):
    kind = p["kind"]
    if kind == "wan":
        h = p["hq"]
        q, k = t["q"].unflatten(2, (h, -1)), t["k"].unflatten(2, (h, -1))
        return fb.qk_norm_rope(q, k, t["qw"], t["kw"], t["cos"], t["sin"], eps=p["eps"],
                               across_heads=True, interleaved=True)
    return fb.qk_norm_rope(t["q"], t["k"], t["qw"], t["kw"], t["cos"], t["sin"], eps=p["eps"],
                           across_heads=kind in ("ltx", "olmo2"),
                           interleaved=kind not in ("qwen3", "olmo2"))


# =========================================================================== the registry

_OPS = [
    OpSpec(
        name="rms_norm", title="RMSNorm",
        shapes=_rms_shapes, build=_rms_build, nbytes=_rms_bytes, reads=("x", "w"),
        fusebox=lambda fb, t, p: fb.rms_norm(t["x"], t["w"], p["eps"]),
        eager=_rms_eager,
        eager_doc="LlamaRMSNorm forward (diffusers RMSNorm with weight None for 'no-w')",
        torch=lambda t, p: F.rms_norm(t["x"], (t["x"].shape[-1],), t["w"], p["eps"]),
        torch_doc="F.rms_norm",
        liger=lambda lk, t, p: lk.liger_rms_norm(t["x"], t["w"], p["eps"]),
        liger_doc="liger_rms_norm (casting_mode llama)",
    ),
    OpSpec(
        name="fused_add_rms_norm", title="residual add + RMSNorm, returns (y, x + residual)",
        shapes=_add_rms_shapes, build=_add_rms_build, nbytes=_add_rms_bytes,
        reads=("x", "residual", "w"),
        fusebox=lambda fb, t, p: fb.fused_add_rms_norm(t["x"], t["residual"], t["w"], p["eps"]),
        eager=_add_rms_eager, eager_doc="h = x + residual; LlamaRMSNorm(h)",
        torch=_add_rms_torch, torch_doc="x + residual; F.rms_norm",
        liger=lambda lk, t, p: lk.liger_fused_add_rms_norm(t["x"], t["residual"], t["w"],
                                                           p["eps"]),
        liger_doc="liger_fused_add_rms_norm",
    ),
    OpSpec(
        name="rms_norm_add", title="RMSNorm, then the residual add: residual + rms_norm(x)",
        shapes=_norm_add_shapes, build=_add_rms_build, nbytes=_norm_add_bytes,
        reads=("x", "residual", "w"),
        fusebox=lambda fb, t, p: fb.rms_norm_add(t["x"], t["residual"], t["w"], p["eps"]),
        eager=lambda t, p: t["residual"] + B.t5_rms_norm(t["x"], t["w"], p["eps"]),
        eager_doc="residual + Olmo2RMSNorm(x)",
        torch=lambda t, p: t["residual"] + F.rms_norm(t["x"], (t["x"].shape[-1],), t["w"], p["eps"]),
        torch_doc="residual + F.rms_norm(x)",
    ),
    OpSpec(
        name="layer_norm", title="LayerNorm with weight and bias",
        shapes=_ln_shapes, build=_ln_build, nbytes=_ln_bytes, reads=("x", "w", "b"),
        fusebox=lambda fb, t, p: fb.layer_norm(t["x"], t["w"], t["b"], p["eps"]),
        eager=_ln_eager,
        eager_doc="nn.LayerNorm (F.layer_norm); Wan: diffusers FP32LayerNorm with fp32 params",
        torch=_ln_torch, torch_doc="F.layer_norm in x's dtype (Wan shapes)",
        liger=lambda lk, t, p: lk.liger_layer_norm(t["x"], t["w"], t["b"], p["eps"]),
        liger_doc="liger_layer_norm",
    ),
    OpSpec(
        name="adaln", title="AdaLN: norm(x) * (1 + scale) + shift",
        shapes=_adaln_shapes, build=lambda p, dt, dev, r: _mod_build(p, dt, dev, r, False),
        nbytes=lambda p, dt: _mod_bytes(p, dt, 1, 1, 2), reads=("x", "scale", "shift"),
        fusebox=lambda fb, t, p: fb.adaln(t["x"], t["scale"], t["shift"], None, None, p["norm"],
                                          p["eps"]),
        eager=_adaln_eager,
        eager_doc="LTX: RMSNorm(no w)*(1+scale)+shift; Flux: LayerNorm; Wan: fp32 LayerNorm + "
                  "fp32 modulation",
        torch=_adaln_torch, torch_doc="F.rms_norm * (1 + scale) + shift",
        liger=_adaln_liger, liger_doc="liger_modulated_rms_norm",
    ),
    OpSpec(
        name="gated_residual", title="AdaLN-Zero gated residual: x + gate * branch",
        shapes=_gr_shapes, build=lambda p, dt, dev, r: _mod_build(p, dt, dev, r, True),
        nbytes=lambda p, dt: _mod_bytes(p, dt, 2, 1, 1), reads=("x", "branch", "gate"),
        fusebox=lambda fb, t, p: fb.gated_residual(t["x"], t["branch"], t["gate"]),
        eager=lambda t, p: B.gated_residual_eager(t["x"], t["branch"], t["gate"], p["fp32"]),
        eager_doc="x + branch * gate; Wan: (x.float() + branch.float() * gate).type_as(x)",
    ),
    OpSpec(
        name="gated_residual_norm",
        title="h = x + gate * branch; out = norm(h) * (1 + scale) + shift; returns (out, h)",
        shapes=_grn_shapes, build=lambda p, dt, dev, r: _mod_build(p, dt, dev, r, True),
        nbytes=lambda p, dt: _mod_bytes(p, dt, 2, 2, 3),
        reads=("x", "branch", "gate", "scale", "shift"),
        fusebox=lambda fb, t, p: fb.gated_residual_norm(
            t["x"], t["branch"], t["gate"], t["scale"], t["shift"], None, None, p["norm"],
            p["eps"]),
        eager=_grn_eager, eager_doc="the gated residual then the adaln chain, as above",
        torch=_grn_torch, torch_doc="x + branch * gate; F.rms_norm * (1 + scale) + shift",
    ),
    OpSpec(
        name="gelu_tanh", title="gelu(x + bias, approximate='tanh') (DiT FFN)",
        shapes=_gelu_shapes, build=_gelu_build, nbytes=_gelu_bytes, reads=("x", "bias"),
        fusebox=lambda fb, t, p: fb.gelu_tanh(t["x"], t["bias"]),
        eager=lambda t, p: B.gelu_tanh_bias_eager(t["x"], t["bias"]),
        eager_doc="F.gelu(x + bias, approximate='tanh')",
    ),
    OpSpec(
        name="swiglu", title="silu(gate) * up, separate gate/up (LlamaMLP)",
        shapes=lambda: _glu_shapes(FFN_ROWS, FFN_WIDTHS, ((16, 12288), (2048, 12288))),
        build=_glu_build, nbytes=_glu_bytes, reads=("gate", "up"),
        fusebox=lambda fb, t, p: fb.gated_activation(t["gate"], t["up"], "silu"),
        eager=lambda t, p: B.swiglu_eager(t["gate"], t["up"]), eager_doc="F.silu(gate) * up",
        liger=lambda lk, t, p: lk.liger_swiglu(t["gate"], t["up"]), liger_doc="liger_swiglu",
    ),
    OpSpec(
        name="geglu", title="gelu_tanh(gate) * up, separate gate/up (Gemma3MLP)",
        shapes=lambda: _glu_shapes(GEMMA_FFN_ROWS, GEMMA_FFN_WIDTHS, ((2048, 10240),)),
        build=_glu_build, nbytes=_glu_bytes, reads=("gate", "up"),
        fusebox=lambda fb, t, p: fb.gated_activation(t["gate"], t["up"], "gelu_tanh"),
        eager=lambda t, p: B.geglu_tanh_eager(t["gate"], t["up"]),
        eager_doc="F.gelu(gate, approximate='tanh') * up",
        liger=lambda lk, t, p: lk.liger_geglu(t["gate"], t["up"]), liger_doc="liger_geglu",
    ),
    OpSpec(
        name="moe_combine", title="MoE combine: each token's top-k expert rows, weighted, summed",
        shapes=_moe_shapes, build=_moe_build, nbytes=_moe_bytes, reads=("rows", "index", "weights"),
        fusebox=lambda fb, t, p: fb.moe_combine(t["rows"], t["index"], t["weights"]),
        eager=_moe_eager,
        eager_doc="transformers grouped experts: rows * fp32 weights, put in token order, "
                  ".sum(1).to(dtype)",
    ),
    OpSpec(
        name="moe_topk", title="MoE router: scores, top-k choice, renormalization, scale, cast",
        shapes=_router_shapes, build=_router_build, nbytes=_router_bytes, reads=("logits", "bias"),
        fusebox=_router_fusebox, eager=_router_eager,
        eager_doc="transformers routers after the GEMM: softmax(dtype=float), topk, /= sum "
                  "(Mixtral, Qwen3-MoE), .to(logits dtype) (OLMoE, Qwen3-MoE); DeepSeek-V3: "
                  "sigmoid + bias, group top-2 sums, group topk, mask, topk, gather, /= sum, * scale",
    ),
    OpSpec(
        name="moe_sort", title="MoE dispatch: the (token, k) pairs sorted by expert, tokens, "
                               "offsets, inverse permutation",
        shapes=_moe_sort_shapes, build=_moe_sort_build, nbytes=_moe_sort_bytes, reads=("index",),
        fusebox=lambda fb, t, p: fb.moe_sort(t["index"], p["experts"]),
        eager=_moe_sort_eager,
        eager_doc="transformers grouped experts: torch.sort, histc + cumsum, perm // K, "
                  "inverse permutation by index_put",
    ),
    OpSpec(
        name="rope", title="rotary, half-split (rotate_half), q and k, GQA",
        shapes=_rope_shapes, build=_rope_build, nbytes=_rope_bytes,
        reads=("q", "k", "cos", "sin"),
        fusebox=lambda fb, t, p: fb.rope(t["q"], t["k"], t["cos"], t["sin"]),
        eager=_rope_eager,
        eager_doc="transformers apply_rotary_pos_emb on [B,H,S,D] views, cos/sin [B,S,D] in "
                  "the model dtype",
        liger=lambda lk, t, p: B.liger_rope_bshd(lk, t["q"], t["k"], t["cos"], t["sin"]),
        liger_doc="liger_rope (in place)",
    ),
    OpSpec(
        name="rope_interleaved", title="rotary, interleaved pairs, fp32 table",
        shapes=_irope_shapes, build=_irope_build, nbytes=_irope_bytes,
        reads=("q", "k", "cos", "sin"),
        fusebox=lambda fb, t, p: fb.rope(t["q"], t["k"], t["cos"], t["sin"], interleaved=True),
        eager=_irope_eager,
        eager_doc="diffusers apply_rotary_emb (use_real_unbind_dim=-1), fp32 math; LTX on the "
                  "flat [B,S,2048] q/k",
    ),
    OpSpec(
        name="rope_3d", title="3-D video rotary, frequencies computed in the kernel (Wan grid)",
        shapes=_rope3d_shapes, build=_rope3d_build, nbytes=lambda p, dt: _qk_bytes(p, dt),
        reads=("q", "k"),
        fusebox=lambda fb, t, p: fb.rope_3d(t["q"], t["k"], *p["grid"]),
        eager=_rope3d_eager,
        eager_doc="Wan's rotary with its precomputed [1,S,1,128] fp32 table (table not counted)",
    ),
    OpSpec(
        name="qk_norm_rope", title="RMSNorm of q and k + rotary, one launch",
        shapes=_qknr_shapes, build=_qknr_build, nbytes=_qknr_bytes,
        reads=("q", "k", "qw", "kw", "cos", "sin"),
        fusebox=_qknr_fusebox, eager=_qknr_eager,
        eager_doc="Qwen3: q_norm/k_norm per head + rotate_half rope; OLMo-2: across heads + "
                  "rotate_half rope from fp32 tables; Flux: nn.RMSNorm per head + "
                  "interleaved fp32 rope; LTX/Wan: nn.RMSNorm across heads + their rope",
        torch=_qknr_torch, torch_doc="F.rms_norm + HF rope (Qwen3, OLMo-2)",
        liger=_qknr_liger, liger_doc="liger_rms_norm x2 + liger_rope (Qwen3)",
    ),
]

REGISTRY: Dict[str, OpSpec] = {op.name: op for op in _OPS}
OP_NAMES = tuple(REGISTRY)


def parse_dtypes(text: str) -> List[str]:
    out = []
    for part in (s.strip().lower() for s in text.split(",") if s.strip()):
        if part not in DTYPE_ALIASES:
            raise ValueError(f"unknown dtype {part!r}; choose from bf16, fp16, fp32")
        name = DTYPE_ALIASES[part]
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError("no dtype given")
    return out


def parse_ops(text: str) -> List[str]:
    parts = [s.strip() for s in text.split(",") if s.strip()]
    if not parts or parts == ["all"]:
        return list(OP_NAMES)
    bad = [s for s in parts if s not in REGISTRY]
    if bad:
        raise ValueError(f"unknown op(s) {', '.join(bad)}; choose from {', '.join(OP_NAMES)}")
    return list(dict.fromkeys(parts))


def parse_groups(text: str) -> List[str]:
    parts = [s.strip().lower() for s in text.split(",") if s.strip()]
    if not parts or "all" in parts:
        return list(GROUPS)
    bad = [s for s in parts if s not in GROUPS]
    if bad:
        raise ValueError(f"unknown shape group(s) {', '.join(bad)}; choose from "
                         f"{', '.join(GROUPS)} or all")
    return list(dict.fromkeys(parts))


def _freeze(v):
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v


def select(ops: Sequence[str], groups: Sequence[str], dtypes: Sequence[str],
           quick: bool = False) -> List[Case]:
    """The cases to run, ordered op by op, dtype by dtype. Identical params listed under several
    of the selected groups run once (the first group wins); the seeds' ``[B x S x D]`` shapes
    are kept under their own labels even where an LLM ``rows x D`` case has the same rows."""
    cases = []
    for op in ops:
        spec = REGISTRY[op]
        for dt in dtypes:
            seen = set()
            for group, label, params, in_quick in spec.shapes():
                if group not in groups or (quick and not in_quick):
                    continue
                key = _freeze(params)
                if key in seen:
                    continue
                seen.add(key)
                cases.append(Case(op, group, label, dict(params), dt))
    return cases


def matching(patterns: Sequence[str], dtype: str) -> List[Case]:
    """The cases of the whole suite in ``dtype`` whose key (``op|shape|dtype``) contains one of
    ``patterns`` (the diagnostic scripts' selection)."""
    return [c for c in select(list(OP_NAMES), list(GROUPS), [dtype])
            if any(p in c.key for p in patterns)]


def build_inputs(case: Case, device, seed: int = 0) -> Dict[str, torch.Tensor]:
    return case.spec.build(case.params, DTYPES[case.dtype], torch.device(device),
                           _Rand(device, seed))
