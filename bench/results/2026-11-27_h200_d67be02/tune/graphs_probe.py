"""Decode under generate's CUDA-graph compile (reduce-overhead), Gemma3-4B cut to a few
layers: per-step time unpatched vs patched, with inductor's cudagraph and recompile logs."""
import statistics, sys, time, logging
import torch, fusebox
from transformers import StaticCache, LogitsProcessor, LogitsProcessorList
from transformers.generation import CompileConfig
from fusebox.bench.e2e import llm as e2e

layers = int(sys.argv[1])
name = sys.argv[2] if len(sys.argv) > 2 else "gemma3-4b"
e2e.CONFIGS[name]["num_hidden_layers"] = layers
model = e2e.build_model(name, torch.device("cuda"), torch.bfloat16).to(torch.bfloat16)
prompt = torch.randint(0, model.config.vocab_size, (1, 32), device="cuda")

class Clock(LogitsProcessor):
    def __init__(self): self.t = []
    def __call__(self, ids, scores):
        torch.cuda.synchronize(); self.t.append(time.perf_counter()); return scores

def run(label):
    torch._dynamo.reset()
    model.__dict__.pop("_compiled_call", None)
    steps = []
    for r in range(3):
        clock = Clock()
        with torch.no_grad():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=33, min_new_tokens=33,
                           do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]),
                           compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"),
                           past_key_values=StaticCache(config=model.config, max_cache_len=80))
        if r:
            steps += [(b - a) * 1e3 for a, b in zip(clock.t[1:], clock.t[2:])]
    print(f"{label}: {statistics.median(steps):.3f} ms a step ({layers} layers)", flush=True)

run("graphs")
fusebox.patch(model)
run("patched+graphs")
fusebox.unpatch(model)
run("graphs again")
