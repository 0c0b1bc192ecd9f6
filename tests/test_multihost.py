"""Multi-host: two processes on 127.0.0.1 (`jax.distributed`, 4 fake CPU devices each) form one
8-device mesh and run sharded speculative generation; the tokens equal a single-process run on
8 devices. The mesh puts every axis across the process boundary (see multihost_child.py). Each
process reads only its own shards of the checkpoint (HF folder or Orbax conversion)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import jax
import pytest

import eagle3_jax as e3
from eagle3_jax.checkpoint import save_orbax
from multihost_child import generate_all
from test_quantized_models import fp8_draft_folder, write_model

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_child.py")
MESH = (2, 2, 2)
TIMEOUT_S = 300

# CI's newest-JAX leg runs it (two processes, each compiling the whole pair): multi-host on the JAX users install
pytestmark = pytest.mark.newest_jax
needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_xla_flags(devices: int = 4) -> str:
    """This process's XLA_FLAGS with the fake CPU device count set to `devices`."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    return " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])


def run_processes(args: list[str], out_dir, num_processes: int = 2) -> list[dict]:
    """Start `num_processes` children, wait for all; one failing stops the others at once."""
    port = free_port()
    procs, outs = [], []
    for i in range(num_processes):
        out = os.path.join(out_dir, f"process{i}.json")
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=child_xla_flags(),
                   EAGLE3_COORDINATOR=f"127.0.0.1:{port}", EAGLE3_NUM_PROCESSES=str(num_processes),
                   EAGLE3_PROCESS_ID=str(i))
        log = open(os.path.join(out_dir, f"process{i}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, CHILD, *args, out], env=env, stdout=log, stderr=subprocess.STDOUT))
        outs.append(out)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for i, out in enumerate(outs):
        if not os.path.exists(out):
            with open(os.path.join(out_dir, f"process{i}.log")) as f:
                log = f.read()[-3000:]
            pytest.fail(f"process {i} wrote no result (exit {procs[i].returncode}); its log ends:\n{log}")
        with open(out) as f:
            results.append(json.load(f))
    return results


@needs_8
def test_two_processes_generate_like_one(tmp_path):
    target = write_model(tmp_path / "target", "kimi_int4")
    draft = fp8_draft_folder(tmp_path / "draft", e3.load_target(target, dtype="float32"))
    orbax = str(tmp_path / "target-orbax")
    save_orbax(target, orbax, e3.load_model_config(target), progress=False)
    results = run_processes([target, orbax, draft, ",".join(map(str, MESH))], tmp_path)
    for i, r in enumerate(results):
        assert "error" not in r, f"process {i} failed:\n{r['error']}"
        assert (r["process_index"], r["process_count"], r["local_devices"], r["devices"]) == (i, 2, 4, 8)
    # Loading: each process read exactly the blocks its devices hold (its own experts), not the model,
    # and restored the same shards from the Orbax conversion.
    for r in results:
        assert r["load"]["read"] == r["load"]["own"] < r["load"]["total"]
        assert r["load"]["orbax_equal"]
    want = generate_all(target, draft, MESH)
    assert results[0]["tokens"] == want
    assert results[1]["tokens"]["tree_sampled"] == want["tree_sampled"]
    assert want["scheduler_auto"] == want["scheduler_chain"]  # greedy: whatever the adaptive steps ran
    for name in ("scheduler_chain", "scheduler_auto"):  # the follower mirrored the decode steps
        assert results[1]["tokens"][f"follower_steps_{name}"] > len(want[name][0]) // 4
    # With the prefix cache: second turns take their first turn's pages, in lockstep.
    assert want["scheduler_cached"][:2] == want["scheduler_chain"] and want["scheduler_cached_hits"][0] > 0
    assert results[0]["tokens"]["scheduler_cached_hits"] == want["scheduler_cached_hits"]
    assert results[1]["tokens"]["follower_steps_scheduler_cached"] > 0
    # ... and from the host tier, each process restoring its own copy of the pages.
    assert want["scheduler_host_tier"] == want["scheduler_cached"] and want["scheduler_host_tier_hits"][1] > 0
    assert results[0]["tokens"]["scheduler_host_tier_hits"] == want["scheduler_host_tier_hits"]
