#!/bin/bash
# Nsight Compute over the chunk kernels, from the checkout's root:
#   bash bench/profiling/ncu_chunk.sh OUTDIR CASE [CASE ...]    (CASE: mid long f32 tf32, see profile_chunk.py)
# Per case (the report itself in /tmp): the details page, the SASS source page (CSV) and the
# most-stalled SASS lines.
out=$1; shift
mkdir -p "$out"
for c in "$@"; do
  ncu --clock-control none --kernel-name regex:rtk_chunk --launch-skip 2 --launch-count 2 --set full \
      --import-source no -f -o "/tmp/$c" python3 bench/profiling/profile_chunk.py run "$c" > "/tmp/$c.ncu.log" 2>&1 || tail -5 "/tmp/$c.ncu.log"
  ncu -i "/tmp/$c.ncu-rep" --page details > "$out/$c.details.txt" 2>&1
  ncu -i "/tmp/$c.ncu-rep" --page source --csv --print-source sass > "$out/$c.sass.csv" 2>&1
  echo "== $c"; grep -E "Duration|Registers Per|Achieved Occupancy|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc A" "$out/$c.details.txt" | head -30
  python3 bench/profiling/profile_chunk.py top "$out/$c.sass.csv" 2>&1 | head -45
done
