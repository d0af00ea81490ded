"""Scratch: SASS of one kernel instance (needs nvdisasm or cuobjdump) and its opcode histogram."""
import collections, os, re, shutil, subprocess, sys, tempfile
from rtkernels.runtime import compile_offline

expr = sys.argv[1] if len(sys.argv) > 1 else "rtk_chunk_fwd<2, 128, 64, 4, true>"
src = sys.argv[2] if len(sys.argv) > 2 else "chunk.cu"
out = sys.argv[3] if len(sys.argv) > 3 else None
prog = compile_offline(src, [expr], "sm_90")
with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
    f.write(prog.cubin)
tool = shutil.which("nvdisasm") or "/usr/local/cuda/bin/nvdisasm"
res = subprocess.run([tool, f.name], capture_output=True, text=True)
sass = res.stdout
if out:
    open(out, "w").write(sass)
ops = collections.Counter()
for line in sass.splitlines():
    m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", line)
    if m:
        ops[m.group(2)] += 1
print(expr, "static SASS instructions:", sum(ops.values()), res.stderr[:200])
for op, n in ops.most_common(40):
    print(f"  {op:10s} {n}")
