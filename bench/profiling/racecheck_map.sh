#!/bin/bash
# compute-sanitizer racecheck over a script, with each reported shared-memory hazard's code offsets
# shown in the SASS of the kernel they belong to. From the checkout's root:
#   KERNEL=MANGLED_PART bash bench/profiling/racecheck_map.sh OUTDIR SCRIPT [ARG ...]
# e.g. KERNEL=Li3ELi2ELb0E for rtk_chunk_fwd<2, 128, 128, true, 1, true, 3, 2, false>. The script
# runs once without the tool (to fill the kernel cache, $RTKERNELS_CACHE_DIR, default
# /tmp/rtk_racecheck), then under racecheck (OUTDIR/racecheck.txt). The cached cubins whose lowered
# (mangled) name contains KERNEL are disassembled (OUTDIR/<key>.sass), and each offset the report
# names is printed with the 6 instructions either side (OUTDIR/map.txt).
out=$1; shift
: "${KERNEL:?set KERNEL to a part of the kernel mangled name}"
mkdir -p "$out"
export RTKERNELS_CACHE_DIR=${RTKERNELS_CACHE_DIR:-/tmp/rtk_racecheck}
python3 "$@" > "$out/plain.txt" 2>&1 || { tail -5 "$out/plain.txt"; exit 1; }
compute-sanitizer --tool racecheck --racecheck-report hazard python3 "$@" > "$out/racecheck.txt" 2>&1
tail -1 "$out/racecheck.txt"
dis=$(command -v nvdisasm || ls /usr/local/cuda*/bin/nvdisasm 2>/dev/null | head -1)
[ -n "$dis" ] || { echo "no nvdisasm" >&2; exit 1; }
: > "$out/map.txt"
for meta in "$RTKERNELS_CACHE_DIR"/kernels/*.json; do
  key=$(basename "$meta" .json)
  grep -qF "$KERNEL" "$meta" || continue
  # (an image cached before 36af34f lacks the cubin's last byte, which nvdisasm needs: whole_cubin)
  python3 -c 'import sys; from rtkernels.jit.compiler import whole_cubin
sys.stdout.buffer.write(whole_cubin(open(sys.argv[1], "rb").read()))' "${meta%.json}.bin" > "$out/$key.cubin"
  "$dis" -c "$out/$key.cubin" > "$out/$key.sass" 2>&1
  for pc in $(grep -oE "\+0x[0-9a-f]+" "$out/racecheck.txt" | sort -u); do
    off=$(printf "%04x" "$((16#${pc#+0x}))")
    { echo "== $key $pc"; grep -B6 -A6 "/\*$off\*/" "$out/$key.sass"; } >> "$out/map.txt"
  done
done
grep -c "^==" "$out/map.txt"
