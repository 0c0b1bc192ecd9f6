"""One process of the multi-host test (tests/test_multihost.py starts two of these).

    python tests/multihost_child.py TARGET TARGET_ORBAX DRAFT MESH OUT_JSON

Joins the job through `eagle3_jax.initialize_distributed` (EAGLE3_COORDINATOR, EAGLE3_NUM_PROCESSES,
EAGLE3_PROCESS_ID), builds one mesh over every process's devices (MESH = data,tensor,expert),
loads the target and draft sharded on it, runs plain and speculative generation (greedy and
sampled) and writes the token ids to OUT_JSON. Any error is written there too, and the process
exits 1 at once so that the launcher can stop its peer.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def checkerboard_devices(mesh_shape: tuple[int, int, int]) -> list:
    """All devices ordered so that mesh position (d, t, e) lies on process (d + t + e) % processes:
    every mesh axis then crosses the process boundary, so every collective (tensor-parallel psum,
    expert-parallel psum, the batch gather over `data`) goes between processes."""
    import itertools

    import jax

    by_process: dict[int, list] = {}
    for device in jax.devices():
        by_process.setdefault(device.process_index, []).append(device)
    queues = [iter(by_process[p]) for p in sorted(by_process)]
    return [next(queues[sum(pos) % len(queues)]) for pos in itertools.product(*map(range, mesh_shape))]


def generate_all(target_path: str, draft_path: str, mesh_shape: tuple[int, int, int]) -> dict:
    """Token ids of a sampled tree run of the Engine, driven by every process alike, and of greedy
    chain and adaptive runs of the Scheduler as multi-host serving runs it: process 0 leads (takes the requests,
    sends each step), the others follow. A follower reports how many steps it mirrored instead.
    In a single process the same runs happen without followers (the test's reference)."""
    import jax

    import eagle3_jax as e3

    mesh = e3.make_mesh(*mesh_shape, devices=checkerboard_devices(mesh_shape))
    target = e3.load_target(target_path, dtype="float32", mesh=mesh)
    draft = e3.load_draft(draft_path, target=target, dtype="float32")
    prompts = [[1, 5, 9, 2], [3, 4, 5, 6, 7, 8]]
    greedy = e3.SamplingParams(max_tokens=10)
    sampled = [e3.SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=s) for s in (3, 4)]
    tree = e3.Engine(target, draft, e3.SpecConfig(3, 2, 6), max_batch_size=2, max_seq_len=64)
    result = {"tree_sampled": [o.token_ids for o in tree.generate(prompts, sampled)]}
    # Adaptive speculation too: its leader-only choices and the draft catch-up programs (every
    # 2 steps without speculation) are mirrored by the followers.
    runs = {"scheduler_chain": e3.SpecConfig(3, 1, 4), "scheduler_auto": e3.SpecConfig.auto(2, max_gap=2)}
    for name, spec in runs.items():
        sched = e3.Scheduler(target, draft, spec, max_num_seqs=2, max_seq_len=64)
        if jax.process_index() > 0:
            result[f"follower_steps_{name}"] = sched.follow()
            continue
        if jax.process_count() > 1:
            sched.lead()
        result[name] = [o.token_ids for o in sched.generate(prompts, greedy)]
        sched.release_followers()
    # The prefix cache is the leader's bookkeeping: the followers run the block tables it sends.
    # With a host tier and a pool too small to keep the first turns' pages past longer requests
    # in between, each process keeps its own host copy of them, copied as the leader says (22 pages:
    # 10 a data shard, what the longest second turn, 17 + 10 tokens and the steps' lookahead, needs).
    for name, kw in (("scheduler_cached", {}), ("scheduler_host_tier", dict(num_pages=22, host_kv_cache_gb=0.001))):
        cached = e3.Scheduler(target, draft, e3.SpecConfig(3, 1, 4), max_num_seqs=2, max_seq_len=64, page_size=4,
                              prefix_caching=True, **kw)
        if jax.process_index() > 0:
            result[f"follower_steps_{name}"] = cached.follow()
            continue
        if jax.process_count() > 1:
            cached.lead()
        first = [o.token_ids for o in cached.generate(prompts, greedy)]
        if kw:
            cached.generate([[11 + i] * 16 for i in range(2)], greedy)
        second = [o.token_ids for o in cached.generate([p + o + [7] for p, o in zip(prompts, first)], greedy)]
        cached.release_followers()
        result[name] = first + second
        stats = cached.stats()
        result[f"{name}_hits"] = [stats["prefix_cache_hits_total"], stats["prefix_cache_host_hits_total"]]
    return result


def load_reads(target_path: str, orbax_path: str) -> dict:
    """Load the target expert-parallel over all devices in their default order (so each process
    holds its own experts) and report the checkpoint bytes this process read, the bytes of the
    distinct blocks its devices hold, and the bytes of the whole model; then restore its Orbax
    conversion onto the same mesh (each process restoring its own shards) and report whether this
    process's shards are bit-identical to the ones read from the HF folder."""
    import jax
    import numpy as np

    import eagle3_jax as e3
    from eagle3_jax.weights import lazy

    before = lazy.bytes_read()
    target = e3.load_target(target_path, dtype="float32", mesh=e3.make_mesh(1, 1, jax.device_count()))
    read = lazy.bytes_read() - before
    own = total = 0
    for leaf in jax.tree.leaves(target.params):
        total += leaf.size * leaf.dtype.itemsize
        blocks = {tuple((s.start, s.stop) for s in shard.index): shard.data.nbytes for shard in leaf.addressable_shards}
        own += sum(blocks.values())
    restored = e3.load_target(orbax_path, dtype="float32", mesh=target.mesh)
    same = jax.tree.structure(restored.params) == jax.tree.structure(target.params) and all(
        np.array_equal(np.asarray(x.data).view(np.uint8), np.asarray(y.data).view(np.uint8))
        for a, b in zip(jax.tree.leaves(target.params), jax.tree.leaves(restored.params))
        for x, y in zip(a.addressable_shards, b.addressable_shards))
    return {"read": read, "own": own, "total": total, "orbax_equal": bool(same)}


def main(target_path: str, orbax_path: str, draft_path: str, mesh_arg: str, out_path: str) -> None:
    import jax

    import eagle3_jax as e3

    e3.initialize_distributed()
    result = {"process_index": jax.process_index(), "process_count": jax.process_count(),
              "local_devices": jax.local_device_count(), "devices": jax.device_count()}
    result["load"] = load_reads(target_path, orbax_path)
    result["tokens"] = generate_all(target_path, draft_path, tuple(int(x) for x in mesh_arg.split(",")))
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("multihost_child done")
    with open(out_path, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    try:
        main(*sys.argv[1:6])
    except BaseException:  # noqa: BLE001 -- report anything, then leave without waiting on peers
        with open(sys.argv[5], "w") as f:
            json.dump({"error": traceback.format_exc()}, f)
        sys.stdout.flush()
        os._exit(1)
