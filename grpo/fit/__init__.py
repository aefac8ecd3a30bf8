"""Fitting a run to its machine: the memory plan (memory.py) and the profile that sizes a run from it
(profile.py), the measured start-up step (preflight.py), the time budget (budget.py), a CPU's threads
and matmul precision (precision.py), and the ways around a GPU-only part that fails (fallback.py).

Its door is one call at setup (grpo/trainer.py's `fit_to_machine`)."""
