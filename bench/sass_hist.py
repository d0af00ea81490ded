"""Scratch: opcode histogram of a kernel's SASS (run where nvdisasm exists)."""
import collections, re, subprocess, sys, tempfile
from rtkernels.runtime import compile_offline

expr = sys.argv[1] if len(sys.argv) > 1 else "rtk_chunk_fwd<2, 128, 64, 4, true>"
src = sys.argv[2] if len(sys.argv) > 2 else "chunk.cu"
prog = compile_offline(src, [expr], "sm_90")
with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
    f.write(prog.cubin)
sass = subprocess.run(["nvdisasm", "-c", f.name], capture_output=True, text=True).stdout
ops = collections.Counter()
for line in sass.splitlines():
    m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
    if m:
        ops[m.group(2).split(".")[0]] += 1
print(expr, "static SASS instructions:", sum(ops.values()))
for op, n in ops.most_common(30):
    print(f"  {op:10s} {n}")
