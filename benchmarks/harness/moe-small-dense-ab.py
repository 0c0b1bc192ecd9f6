"""A/B in one process: small steps' routed experts gathered (per-assignment weight copies) against
dense (every token through every local expert, weights read in place), through the step accounting."""
import json, os
import eagle3_jax as e3
from eagle3_jax import moe
from eagle3_jax.bench.step_accounting import account
from ab_common import demo_pair, swapped

target, draft, prompts = demo_pair()
real_form = moe.expert_form

def dense_small(n, k, w):
    f = real_form(n, k, w)
    return "dense" if f == "gathered" and 2 * n * k >= w.shape[0] else f

def form(dense: bool):
    return swapped(moe, "expert_form", dense_small if dense else real_form)

scheds = {}
for name in ("none", "chain:3:1:4"):
    spec = e3.SpecConfig.parse(name)
    for dense in (False, True):
        scheds[(name, dense)] = e3.Scheduler(target, draft if spec else None, spec, max_num_seqs=8, max_seq_len=424)
rows = []
for rep in range(2):
    for batch in (1, 8):
        for name in ("none", "chain:3:1:4"):
            for dense in ((False, True) if rep == 0 else (True, False)):
                with form(dense):
                    a = account(scheds[(name, dense)], name, prompts, batch=batch, steps=40, runs=30, max_tokens=300)
                rows.append(dict(rep=rep, batch=batch, mode=name, dense=dense, step_ms=round(a.step_ms, 3),
                                 program_ms=round(a.program_ms, 3), verify_ms=round(a.phases["verify"], 3),
                                 tokens=a.tokens_per_step))
                print(rows[-1], flush=True)
os.makedirs("/tmp/acct", exist_ok=True)
json.dump(rows, open("/tmp/acct/moe-small-dense-ab.json", "w"), indent=1)
