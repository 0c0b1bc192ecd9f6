"""Before anyone buys hardware: the AOT memory planner (memory.py: plan_memory), roofline
predictions of a step's time (roofline.py), the tables scripts/plan.py prints from them
(report.py) and the compile gate that compiles the engine's programs and kernels for each target
(compile_gate.py)."""
