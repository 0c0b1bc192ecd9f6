"""The host allocator: scripts that run the engine restart once with tcmalloc preloaded when it is
installed (runtime/host_allocator.py), silently, and say what they run on."""

import os
import subprocess
import sys
import textwrap

import pytest

from eagle3_jax.runtime import host_allocator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALLED = host_allocator.find_tcmalloc() is not None and sys.platform.startswith("linux")

# A script with the engine scripts' runtime flags that reports its process id, LD_PRELOAD and what
# describe() says, or fails on a bad --mesh as a user's mistake.
PROBE = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {root!r})
    from absl import app, flags
    from eagle3_jax.cli import script as cli
    from eagle3_jax.cli.flags import define_runtime_flags
    from eagle3_jax.runtime import host_allocator
    define_runtime_flags("")
    FLAGS = flags.FLAGS

    def main(argv):
        if FLAGS.mesh == ["bad"]:
            raise app.UsageError("--mesh=bad is not a mesh")
        print(json.dumps({{"pid": os.getpid(), "preload": os.environ.get("LD_PRELOAD", ""),
                          "describe": host_allocator.describe(FLAGS.tcmalloc)}}))

    if __name__ == "__main__":
        print(json.dumps({{"started": os.getpid()}}))
        cli.run(main)
""")


def run_probe(tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    path = tmp_path / "probe.py"
    path.write_text(PROBE.format(root=ROOT))
    environ = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    return subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True,
                          env={**environ, **(env or {})}, timeout=120)


def test_preload_list_handling():
    assert host_allocator.preloaded({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"})
    assert host_allocator.preloaded({"LD_PRELOAD": "libiomp5.so:libtcmalloc.so.4"})
    assert not host_allocator.preloaded({"LD_PRELOAD": "/opt/tcmalloc-free/libjemalloc.so"})
    assert not host_allocator.preloaded({})
    assert host_allocator.with_tcmalloc({}, "libtcmalloc_minimal.so.4")["LD_PRELOAD"] == "libtcmalloc_minimal.so.4"
    kept = host_allocator.with_tcmalloc({"LD_PRELOAD": "libiomp5.so", "A": "1"}, "libtcmalloc_minimal.so.4")
    assert kept == {"LD_PRELOAD": "libtcmalloc_minimal.so.4:libiomp5.so", "A": "1"}


def test_find_prefers_the_minimal_build():
    libs = {"tcmalloc": "libtcmalloc.so.4", "tcmalloc_minimal": "libtcmalloc_minimal.so.4"}
    assert host_allocator.find_tcmalloc(libs.get) == "libtcmalloc_minimal.so.4"
    assert host_allocator.find_tcmalloc({"tcmalloc": "libtcmalloc.so.4"}.get) == "libtcmalloc.so.4"
    assert host_allocator.find_tcmalloc({}.get) is None


def test_describe_says_what_runs(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    assert host_allocator.describe() == "tcmalloc (libtcmalloc_minimal.so.4)"
    monkeypatch.delenv("LD_PRELOAD")
    if sys.platform.startswith("linux"):
        assert host_allocator.describe(enabled=False) == "glibc's malloc (--notcmalloc)"
        monkeypatch.setattr(host_allocator, "find_tcmalloc", lambda: None)
        assert "libtcmalloc-minimal4" in host_allocator.describe()
        monkeypatch.setattr(host_allocator, "find_tcmalloc", lambda: "libtcmalloc_minimal.so.4")
        assert "installed but was not preloaded" in host_allocator.describe()


@pytest.mark.skipif(not INSTALLED, reason="tcmalloc is not installed on this host")
def test_a_script_restarts_once_with_tcmalloc(tmp_path):
    r = run_probe(tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    started, *middle, report = [__import__("json").loads(line) for line in r.stdout.splitlines()]
    assert middle == [{"started": started["started"]}]  # the script's top level ran twice, in one process
    assert report["pid"] == started["started"]
    assert host_allocator.preloaded({"LD_PRELOAD": report["preload"]})
    assert report["describe"].startswith("tcmalloc (")


def test_notcmalloc_and_a_users_preload_are_kept(tmp_path):
    r = run_probe(tmp_path, "--notcmalloc")
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2 and '"preload": ""' in lines[1], r.stdout + r.stderr
    r = run_probe(tmp_path, env={"LD_PRELOAD": "libtcmalloc_custom.so"})  # the user's choice: no restart
    assert len(r.stdout.splitlines()) == 2 and '"preload": "libtcmalloc_custom.so"' in r.stdout, r.stdout + r.stderr


def test_a_users_mistake_is_still_one_line(tmp_path):
    r = run_probe(tmp_path, "--mesh=bad")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["probe.py: error: --mesh=bad is not a mesh"], r.stderr
