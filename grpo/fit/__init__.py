"""Fitting a run to its machine: the memory plan (memory.py) and the profile that sizes a run from it
(profile.py), the measured start-up step (preflight.py), the time budget (budget.py), a CPU's threads
and matmul precision (precision.py), the ways around a GPU-only part that fails (fallback.py), and at
setup the run sized and checked against its machine's memory (sizing.py) and built (build.py).

Its door is what grpo/trainer.py calls once at setup (`sizing.fit_to_machine`, `build.build`)."""
