#!/usr/bin/env bash
# The first command of a short GPU session (15 minutes, the machine's start included): bench/gpu_check.py
# from this clone as it is (torch and triton only, nothing installed, no network), under a budget that
# leaves time to rerun a part, every row written under $OUT (what comes back from the machine; default
# bench/gpu_out/) as it is made. 420 s: of 15 minutes, a machine's start (a few) and a rerun of the
# parts that need one (`--only`) are left.
#
#   bash bench/first_run.sh                                         # every stage, 420 s at most
#   bash bench/first_run.sh --only lora_parity,tool_gap_parity --budget 200   # some parts again
set -u
cd "$(dirname "$0")/.."
out="${OUT:-bench/gpu_out}"
mkdir -p "$out"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi" > "$out/nvidia-smi.txt"
# the run's own limit is --budget; this one only stops a supervisor that would outlive the session's command
timeout 480 python bench/gpu_check.py --out "$out" --budget 420 "$@"
rc=$?
echo "first_run: gpu_check exited $rc; rows in $out/parts, report $out/report.json, log $out/log.txt"
exit $rc
