"""`rollplex-trl plan-run`: the modelled time and memory of one GRPO step, per phase, before GPUs are booked.

- `hardware.py`: the devices (published peaks of H100, H200, H800, A100; a custom entry; this machine's CPU from
  `calibrate.py`);
- `step_model.py`: FLOPs and bytes per phase (from prefix/cost.py, the model behind `auto`) turned into seconds for
  three schedules (TRL, serial colocation, Rollplex), with memory from memory/planner.py;
- `calibrate.py`: this machine's matmul FLOP/s, memory bandwidth and per-call overheads (the CPU validation);
- `cli.py`: the `plan-run` command; `gantt.py`: the predicted step as a Gantt PNG.
"""
