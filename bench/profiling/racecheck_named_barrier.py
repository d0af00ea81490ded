"""Does compute-sanitizer's racecheck understand a named barrier of one warp group in a warp-specialized
kernel? A 40-line model of rtk_chunk_fwd's one-copy hand-over: warps 0-3 read a 32 KB buffer in each
period, warps 4-7 overwrite it after the CTA barrier (barrier 0) that ends those reads. The
accesses are ordered by barrier 0 in every case but the planted race.

    python bench/profiling/racecheck_named_barrier.py          # every case under racecheck, a table
    compute-sanitizer --tool racecheck python bench/profiling/racecheck_named_barrier.py CASE

Cases: 0 no other barrier; 1 the readers also meet at barrier 3 (128 threads) before reading;
2 as 1, and the writers meet at barrier 4 at the same point of their period; 3 the readers meet on
an mbarrier instead; 4 as 2, plus a write that truly races with the reads (must be reported).
On an H100 with CUDA 13.0's tool (2026-11-27): 0 clean, 1 reported (4 races; 6,912 byte hazards
with --racecheck-report hazard), 2 clean, 3 clean, 4 reported (1 race; 8,192 byte hazards).
"""
import re
import subprocess
import sys

SOURCE = r"""
template <int CASE>
__global__ void handover(unsigned* out, int periods) {
  extern __shared__ uint4 buf[];
  __shared__ unsigned long long mbar;
  const int tid = threadIdx.x;
  const unsigned mb = (unsigned)__cvta_generic_to_shared(&mbar);
  if (tid == 0) asm volatile("mbarrier.init.shared::cta.b64 [%0], 128;" :: "r"(mb) : "memory");
  __syncthreads();
  unsigned acc = 0;
  if (tid < 128) {  // readers
    asm volatile("barrier.sync 0;" ::: "memory");
    asm volatile("barrier.sync 0;" ::: "memory");
    for (int c = 0; c < periods; ++c) {
      if (CASE == 1 || CASE == 2 || CASE == 4) asm volatile("barrier.sync 3, 128;" ::: "memory");
      if (CASE == 3) {
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(mb) : "memory");
        asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra W; }"
                     :: "r"(mb), "r"(c & 1) : "memory");
      }
      for (int i = tid; i < 2048; i += 128) acc += buf[i].x + buf[i].w;
      asm volatile("barrier.sync 0;" ::: "memory");  // done reading: the writers may go on
      asm volatile("barrier.sync 0;" ::: "memory");  // the next period's data is in place
    }
  } else {  // writers
    asm volatile("barrier.sync 0;" ::: "memory");
    for (int i = tid - 128; i < 2048; i += 128) buf[i] = make_uint4(0u, 1u, 2u, 3u);
    asm volatile("barrier.sync 0;" ::: "memory");
    for (int c = 0; c < periods; ++c) {
      acc += c;
      if (CASE == 2 || CASE == 4) asm volatile("barrier.sync 4, 128;" ::: "memory");
      if (CASE == 4) buf[tid - 128] = make_uint4(c, c, c, c);  // before the readers are done
      asm volatile("barrier.sync 0;" ::: "memory");
      for (int i = tid - 128; i < 2048; i += 128) buf[i] = make_uint4(c, c + 1, c + 2, c + 3);
      asm volatile("barrier.sync 0;" ::: "memory");
    }
  }
  out[tid] = acc;
}
"""
CASES = ("no other barrier", "readers' barrier 3", "readers' barrier 3 + writers' barrier 4",
         "readers' mbarrier", "as 2 + a planted race")


def run(case: int) -> None:
    import cupy as cp

    mod = cp.RawModule(code=SOURCE, options=("-std=c++17",), name_expressions=[f"handover<{case}>"])
    kernel = mod.get_function(f"handover<{case}>")
    kernel.max_dynamic_shared_size_bytes = 32768
    out = cp.zeros(256, dtype=cp.uint32)
    kernel((2,), (256,), (out, cp.int32(4)), shared_mem=32768)
    cp.cuda.runtime.deviceSynchronize()


def main() -> None:
    if len(sys.argv) > 1:
        run(int(sys.argv[1]))
        return
    print("| case | racecheck |\n|---|---|")
    for case, name in enumerate(CASES):
        res = subprocess.run(["compute-sanitizer", "--tool", "racecheck", sys.executable, __file__, str(case)],
                             capture_output=True, text=True)
        found = re.search(r"RACECHECK SUMMARY: .*", res.stdout)
        print(f"| {case}: {name} | {found.group(0) if found else 'no summary (rc %d)' % res.returncode} |")


if __name__ == "__main__":
    main()
