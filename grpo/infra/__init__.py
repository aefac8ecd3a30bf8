"""The plumbing under a run: process groups and FSDP2 (dist.py), resumable checkpoints (checkpoint.py)
and the Hugging Face export (export.py), metrics and trackers (metrics.py, report.py), examples from
files or dataset ids (data.py), and the evals' interval statistics (stats.py)."""
