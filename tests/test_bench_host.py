"""scripts/bench_host.py's library (eagle3_jax.bench.host_time, host_time_engine, launch_cost,
host_report, flag_checks) on hand-made figures and fake schedulers; the script itself runs end to
end in test_bench.py."""

from __future__ import annotations

import cProfile
import gc
import time

import numpy as np
import pytest

from eagle3_jax.bench import flag_checks
from eagle3_jax.bench import host_report as HR
from eagle3_jax.bench import host_time as HT
from eagle3_jax.bench.host_time_engine import engine_row
from eagle3_jax.bench.launch_cost import cache_size_bytes, last_level_cache_bytes, median_launch_ms

# ---- figures --------------------------------------------------------------------------------------------


def test_scheduler_row_leaves_out_the_iterations_that_compiled():
    # (host s, wall s, programs compiled, launch s, CPU s); the second one compiled: left out of every median
    measured = [(0.002, 0.010, 0, 0.001, 0.0015), (0.500, 0.900, 2, 0.100, 0.400), (0.004, 0.012, 0, 0.003, 0.0035),
                (0.003, 0.011, 0, 0.001, 0.0025)]
    phases = [{label: 0.001 * (i + 1) for label, *_ in HT.PHASES} for i in range(3)]
    row = HT.scheduler_row(8, measured, tokens=20, floors=(0.05, 0.4), relaunch=None, phases=phases)
    assert list(row) == ["num_seqs", "iterations", "host_ms_per_iteration", "host_ms_mean",
                         "host_cpu_ms_per_iteration", "launch_ms_per_iteration", "launch_floor_ms",
                         "launch_floor_cold_ms", "step_relaunch_ms", "scheduler_ms_per_iteration",
                         "device_wait_ms_per_iteration", "tokens_per_iteration", "iterations_that_compiled",
                         "phases_ms_per_iteration"]
    assert (row["num_seqs"], row["iterations"], row["iterations_that_compiled"]) == (8, 3, 1)
    assert row["host_ms_per_iteration"] == pytest.approx(3.0) and row["host_ms_mean"] == pytest.approx(3.0)
    assert row["host_cpu_ms_per_iteration"] == pytest.approx(2.5)
    assert row["launch_ms_per_iteration"] == pytest.approx(1.0)
    assert row["scheduler_ms_per_iteration"] == pytest.approx(1.0)  # median of host - launch: 1, 1, 2 ms
    assert row["device_wait_ms_per_iteration"] == pytest.approx(8.0)  # median of wall - host: 8, 8, 8 ms
    assert row["tokens_per_iteration"] == 5.0  # over every measured iteration, the compiling one too
    assert (row["launch_floor_ms"], row["launch_floor_cold_ms"], row["step_relaunch_ms"]) == (0.05, 0.4, None)
    assert row["phases_ms_per_iteration"] == {label: pytest.approx(2.0) for label, *_ in HT.PHASES}
    assert "phases_ms_per_iteration" not in HT.scheduler_row(8, measured, 20, (0.05, 0.4), 0.1)


def test_engine_row_skips_the_warmup_and_the_compiling_steps():
    # steps: (wall s, CPU s, host s, compiled); outer: the engine iteration's (wall s, CPU s) around each
    steps = [(1.0, 1.0, 1.0, 3), (0.010, 0.004, 0.006, 0), (0.5, 0.5, 0.5, 1), (0.012, 0.006, 0.008, 0),
             (0.014, 0.008, 0.010, 0), (0.020, 0.010, 0.012, 0)]  # the last one past warmup + iterations
    outer = [(1.1, 1.1), (0.013, 0.005), (0.6, 0.6), (0.014, 0.008), (0.020, 0.011), (0.030, 0.020)]
    row = engine_row(4, steps, outer, warmup=1, iterations=4)
    assert (row["num_seqs"], row["iterations"], row["iterations_that_compiled"]) == (4, 3, 1)
    assert row["host_ms_per_iteration"] == pytest.approx(8.0)
    assert row["engine_cpu_ms_outside_step"] == pytest.approx(2.0)  # 1, 2, 3 ms
    assert row["engine_wall_ms_outside_step"] == pytest.approx(3.0)  # 3, 2, 6 ms
    assert row["engine_host_ms_per_iteration"] == pytest.approx(10.0)  # 9, 10, 16 ms
    # the engine shut down before all the iterations ran: only those that ran are counted
    assert engine_row(4, steps[:3], outer[:3], warmup=1, iterations=4)["iterations_that_compiled"] == 1


# ---- timers on a fake scheduler -------------------------------------------------------------------------------


class _Part:
    def __init__(self, log: list):
        self.log = log

    def admit(self, n):
        self.log.append(("admit", n))
        time.sleep(0.002)
        return n + 1

    def read(self, out):
        end = time.thread_time() + 0.003
        while time.thread_time() < end:  # the thread's own CPU time
            pass
        return out


class _Stats:
    def __init__(self):
        self.host = self.launch = 0.0
        self.tokens = 0


class _Programs:
    num_compiles = 0


class _Delta:
    def __init__(self, finished: bool):
        self.finished = finished


class _FakeScheduler:
    """Steps that take 1 ms of host time (0.25 of it launches), compile a program on the second
    step, and finish a request every other step."""

    def __init__(self):
        self.log, self.stats_ = [], _Stats()
        self._batch, self._executor, self.programs = _Part(self.log), _Part(self.log), _Programs()
        self.steps = 0

    def stats(self) -> dict:
        return {"host_seconds_total": self.stats_.host, "launch_seconds_total": self.stats_.launch,
                "generation_tokens_total": self.stats_.tokens}

    def step(self):
        self.steps += 1
        self._batch.admit(self.steps)
        self._executor.read(None)
        self.stats_.host += 0.001
        self.stats_.launch += 0.00025
        if self.steps == 2:
            self.programs.num_compiles += 1
        return [_Delta(self.steps % 2 == 0)]


def test_phase_timers_wrap_the_methods_and_add_up_their_seconds():
    sched = _FakeScheduler()
    phases = (("admission", "_batch", "scheduler/batch.py", "admit"),)
    seconds = HT.install_phase_timers(sched, phases)
    assert sched._batch.admit(4) == 5 and sched.log == [("admit", 4)]
    assert list(seconds) == ["admission"] and seconds["admission"] >= 0.002
    with pytest.raises(TypeError):
        sched._batch.admit()  # a failing call is timed too, and raises as it did
    assert [label for label, *_ in HT.PHASES][0] == "admission"


def test_read_cpu_counts_the_reads_thread_time():
    sched = _FakeScheduler()
    spent = HT.count_read_cpu(sched)
    assert sched._executor.read("out") == "out" and spent[0] >= 0.003


def test_run_iterations_submits_for_finished_requests_and_profiles_clean_ones():
    sched, submitted = _FakeScheduler(), []
    seconds = HT.install_phase_timers(sched, (("admission", "_batch", "scheduler/batch.py", "admit"),))
    read_cpu = HT.count_read_cpu(sched)
    profiles, phases = [], []
    measured = HT.run_iterations(sched, lambda: submitted.append(1), 4, read_cpu, seconds, profiles, phases)
    assert len(measured) == 4 and len(submitted) == 2  # steps 2 and 4 finished a request
    assert [m[2] for m in measured] == [0, 1, 0, 0]
    assert all(m[0] == pytest.approx(0.001) and m[3] == pytest.approx(0.00025) for m in measured)
    assert all(m[1] >= 0.002 for m in measured)  # the wall time holds the admission's sleep
    assert all(m[4] < 0.003 for m in measured)  # the thread's CPU time leaves out the read's 3 ms
    assert len(profiles) == 3 and all(isinstance(p, cProfile.Profile) for p in profiles)
    assert len(phases) == 3 and all(p["admission"] >= 0.002 for p in phases)
    # cleared before every iteration: each clean iteration's admission fits in its own wall time
    assert all(p["admission"] <= m[1] for p, m in zip(phases, [measured[0], *measured[2:]]))


def test_measured_rows_run_every_setting_and_size_and_unfreeze_the_heap():
    calls = []

    def measure(target, draft, spec, n, options, tokenizer):
        calls.append((spec, n, options.warmup, tokenizer))
        HT.freeze_heap()
        return HT.HostMeasurement({"num_seqs": n, "x": 1.0})

    options = HT.HostTimeOptions(warmup=3)
    rows = [m.row for m in HT.measured_rows(measure, None, None, [("none", None), ("chain", "C")], [2, 4], options,
                                            "tok")]
    assert calls == [(None, 2, 3, "tok"), (None, 4, 3, "tok"), ("C", 2, 3, "tok"), ("C", 4, 3, "tok")]
    assert rows[0] == {"spec": "none", "num_seqs": 2, "x": 1.0} and list(rows[3]) == ["spec", "num_seqs", "x"]
    assert gc.get_freeze_count() == 0

    def failing(*args):
        HT.freeze_heap()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        list(HT.measured_rows(failing, None, None, [("none", None)], [1], options))
    assert gc.get_freeze_count() == 0


# ---- launch costs ----------------------------------------------------------------------------------------------


def test_cache_sizes_from_sysfs(tmp_path):
    assert [cache_size_bytes(t) for t in ("32K\n", "8M", "512", "1024k")] == [32 << 10, 8 << 20, 512, 1 << 20]
    for i, size in enumerate(("48K", "2048K", "36M")):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    assert last_level_cache_bytes(str(tmp_path / "index*" / "size")) == 36 << 20
    assert last_level_cache_bytes(str(tmp_path / "none*")) == 64 << 20


def test_median_launch_ms_threads_the_state_through():
    before = []

    def launch(state):
        time.sleep(0.001 * (1 + state % 2))
        return np.zeros(()), state + 1

    ms, state = median_launch_ms(launch, 0, 5, before_each=lambda: before.append(1))
    assert state == 5 and len(before) == 5 and 1.0 <= ms < 50  # the median of 1, 2, 1, 2, 1 ms of sleep


# ---- tables and record ------------------------------------------------------------------------------------------


def test_tables_and_cells():
    row = {"spec": "none", "num_seqs": 2, "host_ms_per_iteration": 1.234, "engine_cpu_ms_outside_step": 0.5,
           "engine_wall_ms_outside_step": None, "engine_host_ms_per_iteration": 2.0, "iterations": 6,
           "iterations_that_compiled": 0}
    assert HR.cell("{engine_wall_ms_outside_step:.3f}", row) == "-" and HR.cell("{iterations}", row) == "6"
    header = HR.table_header(HR.ENGINE_COLUMNS).splitlines()
    assert header[0].startswith("| spec | seqs | scheduler host ms / iteration (median) |")
    assert header[1] == "|---|---|" + "---|" * 6
    assert HR.table_row(HR.ENGINE_COLUMNS, row) == "| none | 2 | 1.23 | 0.500 | - | 2.00 | 6 | 0 |"
    assert len(HR.SCHEDULER_COLUMNS) == 12
    rows = [{"spec": s, "num_seqs": n, "phases_ms_per_iteration": {label: n / 8 for label, *_ in HT.PHASES}}
            for s, n in (("none", 2), ("chain:3:1:4", 4))]
    lines = HR.phases_table(rows).splitlines()
    assert lines[:3] == ["", "| phase (host ms / iteration, median) | none x2 | chain:3:1:4 x4 |", "|---|---|---|"]
    assert lines[3] == "| admission | 0.250 | 0.500 |" and len(lines) == 3 + len(HT.PHASES)


def test_profile_tables_sum_each_phase_and_rank_by_own_time():
    stats = {("/x/eagle3_jax/scheduler/batch.py", 10, "admit"): (4, 4, 0.001, 0.004, {}),
             ("/y/other/batch.py", 3, "admit"): (2, 2, 0.5, 0.5, {}),  # another file's admit: not the phase
             ("/x/eagle3_jax/scheduler/core.py", 50, "_emit"): (40, 40, 0.010, 0.020, {}),
             ("~", 0, "<built-in method len>"): (400, 400, 0.002, 0.002, {})}
    text = HR.profile_tables(stats, iterations=2, top=2)
    lines = text.split("\n")
    assert lines[:3] == ["", "| phase | ms / iteration (cumulative) |", "|---|---|"]
    assert "| admission | 2.000 |" in lines and "|   per-token emission | 10.000 |" in lines
    assert "| decode launch | 0.000 |" in lines
    top = lines[lines.index("| function (top 2 by own time) | calls / iteration | own ms / iteration | "
                            "cumulative ms |") + 2:]
    assert top == ["| other/batch.py:3(admit) | 1.0 | 250.000 | 250.000 |",
                   "| scheduler/core.py:50(_emit) | 20.0 | 5.000 | 10.000 |", ""]
    profiler = cProfile.Profile()
    profiler.enable()
    sorted(range(10))
    profiler.disable()
    merged = HR.merged_stats([profiler, profiler])
    assert any(name == "<built-in method builtins.sorted>" and v[0] == 2 for (_, _, name), v in merged.items())


def test_host_time_record():
    record = HR.host_time_record([{"spec": "none"}], argv=["scripts/bench_host.py", "--spec=none"], overlap=False,
                                 detokenize=True, stop_string="###", through_engine=False, stand_in_device=True,
                                 date="2026-01-02", machine="m")
    assert record == {"command": "python scripts/bench_host.py --spec=none", "date": "2026-01-02", "machine": "m",
                      "overlap": False, "detokenize": True, "stop_string": "###", "through_engine": False,
                      "stand_in_device": True, "rows": [{"spec": "none"}]}
    assert "CPU cores" in HR.host_time_record([], argv=[], overlap=True, detokenize=False, stop_string=None,
                                              through_engine=True, stand_in_device=False)["machine"]


# ---- flag values ------------------------------------------------------------------------------------------------


def test_host_flag_checks():
    assert flag_checks.num_seqs(["64", "256", "64"]) == [64, 256, 64]
    with pytest.raises(ValueError, match="--num_seqs must be comma-separated integers; got 'a,2'"):
        flag_checks.num_seqs(["a", "2"])
    for bad in ([], ["0"], ["4", "-1"]):
        with pytest.raises(ValueError, match="--num_seqs needs integers >= 1"):
            flag_checks.num_seqs(bad)
    flag_checks.check_token_range(4, 4)
    with pytest.raises(ValueError, match=r"--min_tokens \(5\) exceeds --max_tokens \(4\)"):
        flag_checks.check_token_range(5, 4)
    modes = dict(through_engine=False, phases=True, profile=3, stop_string="x", detokenize=True)
    flag_checks.check_host_modes(**modes)
    for change in ({"through_engine": True}, {"through_engine": True, "phases": False}):
        with pytest.raises(ValueError, match="leave them out with --through_engine"):
            flag_checks.check_host_modes(**{**modes, **change})
    flag_checks.check_host_modes(**{**modes, "through_engine": True, "phases": False, "profile": 0})
    with pytest.raises(ValueError, match="--stop_string needs --detokenize"):
        flag_checks.check_host_modes(**{**modes, "detokenize": False})
