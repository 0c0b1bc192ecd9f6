"""A/B in one process: the XLA:CPU dense expert form against the grouped form it replaces, through the
step accounting (run from the repository root; writes /tmp/acct/ab_moe.json, recorded as moe-dense-ab.json)."""
import json, os
import eagle3_jax as e3
from eagle3_jax import moe
from eagle3_jax.bench.step_accounting import account
from ab_common import demo_pair, swapped

target, draft, prompts = demo_pair()
real_form = moe.expert_form

def grouped_not_dense(n, k, w):
    f = real_form(n, k, w)
    return "grouped" if f == "dense" else f

def form(dense: bool):
    return swapped(moe, "expert_form", real_form if dense else grouped_not_dense)

scheds = {}
for name in ("none", "chain:3:1:4"):
    spec = e3.SpecConfig.parse(name)
    for dense in (False, True):
        scheds[(name, dense)] = e3.Scheduler(target, draft if spec else None, spec, max_num_seqs=48, max_seq_len=424)
rows = []
for rep in range(2):
    for batch in (8, 48):
        for name in ("none", "chain:3:1:4"):
            for dense in ((False, True) if rep == 0 else (True, False)):
                with form(dense):
                    a = account(scheds[(name, dense)], name, prompts, batch=batch, steps=30, runs=20, max_tokens=300)
                rows.append(dict(rep=rep, batch=batch, mode=name, dense=dense, step_ms=a.step_ms, program_ms=a.program_ms,
                                 verify_ms=a.phases["verify"], tokens=a.tokens_per_step))
                print(rows[-1], flush=True)
os.makedirs("/tmp/acct", exist_ok=True)
json.dump(rows, open("/tmp/acct/ab_moe.json", "w"), indent=1)
