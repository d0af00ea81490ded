#!/usr/bin/env bash
# A/B of kernel trees in one GPU session: bwd_breakdown.py (mid, --flush) for each tree in turn,
# ROUNDS rounds alternating, then the median of each run's steady steps (the first step dropped).
# A tree is a directory holding rtkernels/, cuda_src/ and bench/ (a copy of a checkout); "." is
# this one. The trees may share RTKERNELS_CACHE_DIR: kernels are cached by the hash of their
# source, so each tree runs its own builds.
#   bash bench/profiling/ab_breakdown.sh [--fixed] TREE [TREE ...]    (ROUNDS=2, SHAPE=mid)
# --fixed: the fixed-decay step (default: a trainable decay). Without the first (warm-up) run of a
# tree its compiles would land in the first timed run.
set -u
mode=--trainable
[ "${1:-}" = --fixed ] && { mode=""; shift; }
[ $# -ge 1 ] || { echo "usage: ab_breakdown.sh [--fixed] TREE [TREE ...]" >&2; exit 2; }
run() { PYTHONPATH=$1 python3 "$1/bench/profiling/bwd_breakdown.py" "${SHAPE:-mid}" $mode --flush 2>&1; }
for t in "$@"; do run "$t" > /dev/null; done  # warm-up: compile each tree's kernels
for r in $(seq "${ROUNDS:-2}"); do
  for t in "$@"; do
    out=$(run "$t")
    kernels=$(echo "$out" | grep -E "^ +[0-9.]+ ms  " | grep -v "total GPU" | sed -E 's/^ +([0-9.]+) ms  (void )?([^(]{0,60}).*/\1 \3/' | paste -sd';')
    busy=$(echo "$out" | sed -nE 's/.*kernels busy ([0-9.]+) ms.*/\1/p' | tail -n +2 | sort -n |
           awk '{a[NR]=$1} END {print (NR % 2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}')
    echo "round $r  $t  step median ${busy} ms  | $kernels"
  done
done
