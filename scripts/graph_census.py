"""What the CUDA graphs of a compiled decode step hold, and what their launch costs.

`generate` with a static cache and ``mode="reduce-overhead"`` records the decode step as CUDA
graphs (cudagraph trees). This script records them unpatched and fusebox-patched, keeps each
graph's ``cudaGraph_t`` (torch destroys it after instantiation by default), and prints per graph:
the nodes by type, the kernel nodes by library (their function name) with their parameter bytes,
the edges by type and the branching (nodes of several dependencies or dependents). It then times
the host side of cuGraphLaunch, on an idle GPU and behind a running kernel, for copies of each
graph in which the kernels of some libraries are swapped for an empty kernel (with no parameters,
or with 4096 parameter bytes) or the programmatic edges made plain ones, to find what the launch
time grows with. A diagnostic aid.

    python scripts/graph_census.py --model gemma3-4b
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections import Counter, defaultdict

import torch

cuda = None  # the CUDA driver library, loaded by main()
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty",
              6: "wait_event", 7: "event_record", 8: "ext_sem_signal", 9: "ext_sem_wait",
              10: "mem_alloc", 11: "mem_free", 12: "batch_mem_op", 13: "conditional"}


class KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with CUresult {status}")


def nodes_of(graph) -> list:
    n = ctypes.c_size_t(0)
    check(cuda.cuGraphGetNodes(graph, None, ctypes.byref(n)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * n.value)()
    check(cuda.cuGraphGetNodes(graph, nodes, ctypes.byref(n)), "cuGraphGetNodes")
    return list(nodes)


def node_type(node) -> str:
    t = ctypes.c_int(0)
    check(cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)), "cuGraphNodeGetType")
    return NODE_TYPES.get(t.value, str(t.value))


def kernel_info(node) -> tuple[str, int, KernelNodeParams]:
    """(function name, parameter bytes, params) of a kernel node."""
    p = KernelNodeParams()
    check(cuda.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(p)),
          "cuGraphKernelNodeGetParams")
    name = ctypes.c_char_p()
    func = p.func
    if not func and p.kern:
        f = ctypes.c_void_p()
        check(cuda.cuKernelGetFunction(ctypes.byref(f), ctypes.c_void_p(p.kern)), "cuKernelGetFunction")
        func = f.value
    check(cuda.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(func)), "cuFuncGetName")
    size, index = 0, 0
    while True:
        off, sz = ctypes.c_size_t(), ctypes.c_size_t()
        if cuda.cuFuncGetParamInfo(ctypes.c_void_p(func), ctypes.c_size_t(index), ctypes.byref(off),
                                   ctypes.byref(sz)) != 0:
            break
        size = off.value + sz.value
        index += 1
    return name.value.decode(errors="replace"), size, p


def library(name: str) -> str:
    if "fusebox" in name:
        return "fusebox"
    if name.startswith("triton") or name.startswith("triton_"):
        return "triton"
    if name.startswith(("nvjet", "sm90_", "sm80_", "cutlass", "gemv", "gemmk", "gemmSN", "Kernel")):
        return "cublas"
    if "flash" in name or "fmha" in name or "attention" in name.lower():
        return "attention"
    if name.startswith("_ZN2at") or "at::native" in name:
        return "aten"
    return "other"


def edge_list(graph) -> tuple:
    """(sources, destinations, edge data) of every edge of ``graph``."""
    e = ctypes.c_size_t(0)
    check(cuda.cuGraphGetEdges_v2(graph, None, None, None, ctypes.byref(e)), "cuGraphGetEdges")
    src = (ctypes.c_void_p * e.value)()
    dst = (ctypes.c_void_p * e.value)()
    data = (EdgeData * e.value)()
    check(cuda.cuGraphGetEdges_v2(graph, src, dst, data, ctypes.byref(e)), "cuGraphGetEdges")
    return src, dst, data


def edges_of(graph) -> tuple[Counter, int]:
    """Edge types, and the nodes with several dependencies or dependents."""
    src, dst, data = edge_list(graph)
    types = Counter("programmatic" if d.type else "default" for d in data)
    fan_in, fan_out = Counter(dst), Counter(src)
    branching = sum(1 for c in fan_in.values() if c > 1) + sum(1 for c in fan_out.values() if c > 1)
    return types, branching


CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION

EMPTY_PTX = b"""
.version 7.8
.target sm_90
.address_size 64
.visible .entry fb_empty() { ret; }
.visible .entry fb_empty_params(.param .align 8 .b8 p[4096]) { ret; }
"""


def empty_kernels():
    module = ctypes.c_void_p()
    check(cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(EMPTY_PTX)), "cuModuleLoadData")
    out = []
    for name in (b"fb_empty", b"fb_empty_params"):
        f = ctypes.c_void_p()
        check(cuda.cuModuleGetFunction(ctypes.byref(f), module, name), "cuModuleGetFunction")
        out.append(f)
    return out


PENDING_CYCLES = 400_000  # a sleep kernel of about 200 us queued ahead of the launch


def launch_us(graph, repeats: int = 30) -> tuple[float, float]:
    """Median host time of cuGraphLaunch for a fresh instantiation of ``graph``: on an idle GPU,
    and behind a sleeping kernel still running on the stream (as a decode step launches its
    graph behind the small kernels of the generate loop)."""
    exec_ = ctypes.c_void_p()
    check(cuda.cuGraphInstantiateWithFlags(ctypes.byref(exec_), graph, ctypes.c_ulonglong(0)),
          "cuGraphInstantiate")
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    check(cuda.cuGraphUpload(exec_, stream), "cuGraphUpload")
    idle, pending = [], []
    for _ in range(repeats):
        for times in (idle, pending):
            torch.cuda.synchronize()
            if times is pending:
                torch.cuda._sleep(PENDING_CYCLES)
            start = time.perf_counter()
            check(cuda.cuGraphLaunch(exec_, stream), "cuGraphLaunch")
            times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    cuda.cuGraphExecDestroy(exec_)
    return statistics.median(idle), statistics.median(pending)


def swapped(graph, libs: set, keep_param_bytes: bool, empties) -> ctypes.c_void_p:
    """A copy of ``graph`` whose kernels of ``libs`` run an empty kernel on one thread."""
    clone = ctypes.c_void_p()
    check(cuda.cuGraphClone(ctypes.byref(clone), graph), "cuGraphClone")
    buffer = (ctypes.c_ubyte * 4096)()
    args = (ctypes.c_void_p * 1)(ctypes.cast(buffer, ctypes.c_void_p))
    for node in nodes_of(clone):
        if node_type(node) != "kernel":
            continue
        name, size, _ = kernel_info(node)
        if library(name) not in libs:
            continue
        p = KernelNodeParams()
        p.func = empties[1].value if keep_param_bytes else empties[0].value
        p.grid[:] = [1, 1, 1]
        p.block[:] = [1, 1, 1]
        p.params = ctypes.cast(args, ctypes.c_void_p).value if keep_param_bytes else None
        # a kernel recorded with a cluster shape keeps it as a node attribute: one block clusters
        cluster = (ctypes.c_uint * 16)(1, 1, 1)
        cuda.cuGraphKernelNodeSetAttribute(ctypes.c_void_p(node), CLUSTER_DIMENSION, cluster)
        check(cuda.cuGraphKernelNodeSetParams_v2(ctypes.c_void_p(node), ctypes.byref(p)),
              "cuGraphKernelNodeSetParams")
    return clone


def with_plain_edges(graph) -> None:
    """Turns the programmatic-launch edges of ``graph`` into plain dependencies, in place."""
    for a, b, d in zip(*edge_list(graph)):
        if not d.type:
            continue
        a, b = ctypes.c_void_p(a), ctypes.c_void_p(b)
        check(cuda.cuGraphRemoveDependencies_v2(graph, ctypes.byref(a), ctypes.byref(b), ctypes.byref(d),
                                                ctypes.c_size_t(1)), "cuGraphRemoveDependencies")
        check(cuda.cuGraphAddDependencies_v2(graph, ctypes.byref(a), ctypes.byref(b), None,
                                             ctypes.c_size_t(1)), "cuGraphAddDependencies")


def census(label: str, tree_nodes: list, empties) -> None:
    for i, tree_node in enumerate(tree_nodes):
        raw = ctypes.c_void_p(tree_node.graph.raw_cuda_graph())
        nodes = nodes_of(raw)
        types = Counter(node_type(n) for n in nodes)
        libs = defaultdict(lambda: [0, 0, Counter()])
        for n in nodes:
            if node_type(n) == "kernel":
                name, size, _ = kernel_info(n)
                entry = libs[library(name)]
                entry[0] += 1
                entry[1] += size
                entry[2][name[:60]] += 1
        edges, branching = edges_of(raw)
        print(f"{label} graph {i}: {len(nodes)} nodes {dict(types)}; edges {dict(edges)}, "
              f"{branching} branching nodes; inputs: "
              f"{len(tree_node.wrapped_function.static_input_idxs)} static, "
              f"{len(tree_node.non_static_input_idx)} copied in each replay; "
              f"{len(tree_node.outputs_metadata)} outputs")
        for lib, (count, size, names) in sorted(libs.items(), key=lambda kv: -kv[1][0]):
            print(f"   {lib}: {count} kernels, {size / max(count, 1):.0f} parameter bytes each; "
                  + ", ".join(f"{k} x{v}" for k, v in names.most_common(4)))
        if len(nodes) < 50:
            continue
        # Replaying the recorded graph itself is not safe here: outside the tree's bookkeeping its
        # inputs are stale, and the indexing kernels (inductor's, aten's) assert on them. These
        # libraries always run as an empty kernel; the others run for real or as an empty kernel.
        present = set(libs)
        unsafe = present & {"triton", "aten", "other"}
        trials = [(unsafe, False, False), (unsafe, False, True), (unsafe | {"fusebox"}, False, False),
                  (unsafe | {"cublas"}, False, False), (present, False, False), (present, False, True),
                  (present, True, False)]
        for swap, keep, plain in dict.fromkeys((frozenset(w), k, p) for w, k, p in trials):
            real = sorted(present - swap)
            what = ("real: " + "+".join(real)) if real else "every kernel empty"
            what += "" if not keep else ", the empty kernels of 4096 parameter bytes"
            what += "" if not plain else ", programmatic edges made plain"
            try:
                clone = swapped(raw, swap, keep, empties)
                if plain:
                    with_plain_edges(clone)
                idle, pending = launch_us(clone)
                cuda.cuGraphDestroy(clone)
                print(f"   cuGraphLaunch on the host, {what}: {idle:.0f} us on an idle GPU, "
                      f"{pending:.0f} us behind a running kernel")
            except RuntimeError as e:
                print(f"   cuGraphLaunch, {what}: {e}")


def host_profile(label: str, generate, top: int) -> None:
    """cProfile of three greedy generates of 17 tokens (16 decode steps each)."""
    import cProfile
    import io
    import pstats

    walls = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) * 1e3)
    print(f"{label}: a generate of 17 tokens {statistics.median(walls):.2f} ms (median of 5), unprofiled")
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(3):
        generate()
    torch.cuda.synchronize()
    profiler.disable()
    print(f"{label}: three generates under cProfile {(time.perf_counter() - start) * 1e3:.1f} ms; "
          "functions by own time, totals over the three:")
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    for line in text.getvalue().splitlines():
        if line.strip():
            print("   " + line)


def main() -> None:
    global cuda
    from fusebox.bench.e2e import llm
    from transformers import StaticCache
    from transformers.generation import CompileConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-4b", choices=sorted(llm.CONFIGS))
    parser.add_argument("--cprofile", type=int, default=25, metavar="N",
                        help="also print the N Python functions of most own time in generate (0: off)")
    args = parser.parse_args()
    cuda = ctypes.CDLL("libcuda.so.1")

    class KeptGraph(torch.cuda.CUDAGraph):
        """A CUDA graph that keeps its cudaGraph_t, instantiated as soon as it is recorded."""

        def __new__(cls, keep_graph: bool = True):
            return super().__new__(cls, True)

        def __init__(self, keep_graph: bool = True) -> None:  # the C++ class reads it here
            super().__init__(True)

        def capture_end(self) -> None:
            super().capture_end()
            self.instantiate()

    torch.cuda.CUDAGraph = KeptGraph
    device = torch.device("cuda")
    model = llm.build_model(args.model, device, torch.bfloat16).to(torch.bfloat16)
    config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    prompt = torch.randint(0, model.config.vocab_size, (1, 32), device=device)
    empties = empty_kernels()
    from torch._inductor import cudagraph_trees

    @torch.no_grad()
    def generate():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=17, min_new_tokens=17,
                       do_sample=False, pad_token_id=0, compile_config=config,
                       past_key_values=StaticCache(config=model.config, max_cache_len=56))

    for label in ("unpatched", "patched"):
        llm._set_variant(model, label)   # torch._dynamo.reset() clears the cudagraph trees too
        for _ in range(2):
            generate()
        manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
        stack = [node for nodes in manager.roots.values() for node in nodes]
        tree_nodes = []
        while stack:
            node = stack.pop()
            stack += [child for children in node.children.values() for child in children]
            if getattr(node, "graph", None) is not None:
                tree_nodes.append(node)
        census(label, tree_nodes, empties)
        if args.cprofile:
            host_profile(label, generate, args.cprofile)


if __name__ == "__main__":
    main()
