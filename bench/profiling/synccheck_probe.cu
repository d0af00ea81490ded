// compute-sanitizer synccheck on the barrier forms a warp-specialized kernel may use: two warp
// groups (warps 0-3, 4-7) reach barrier 0 from different places. nvcc -arch=sm_90 -o probe
// synccheck_probe.cu; compute-sanitizer --tool synccheck ./probe V (V = 1..7). H200, 2026-11-26:
// barrier.sync 0 (1), named barrier.sync (3, 6), one shared call site (4) and a converged barrier (5)
// pass; bar.sync (2, .aligned) and barrier.red.or (7) are reported as divergent.
#include <cstdio>
__device__ __noinline__ void shared_sync0() { asm volatile("barrier.sync 0;" ::: "memory"); }
template <int V>
__global__ void probe(float* out) {
  __shared__ float s[256];
  const int t = threadIdx.x, w = t >> 5;
  s[t] = (float)t;
  if (w < 4) {                       // "producer" group: its own work, then the barrier
    float a = 0.f;
    for (int i = 0; i < 8; ++i) a += s[(t + i) & 255];
    if (V == 1) asm volatile("barrier.sync 0;" ::: "memory");
    if (V == 2) asm volatile("bar.sync 0;" ::: "memory");
    if (V == 3) asm volatile("barrier.sync 1, 256;" ::: "memory");
    if (V == 4) shared_sync0();
    if (V == 6) asm volatile("barrier.sync 0, 256;" ::: "memory");
    if (V == 7) { unsigned any; asm volatile("{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n barrier.red.or.pred q, 0, p;\n selp.u32 %0, 1, 0, q;\n}" : "=r"(any) : "r"((unsigned)(a > 1e9f)) : "memory"); a += any; }
    out[t] = a;
  } else {                           // "consumer" group: other work, the barrier at another place
    float b = 1.f;
    for (int i = 0; i < 4; ++i) b *= 1.f + s[(t * 3 + i) & 255] * 1e-3f;
    if (V == 1) asm volatile("barrier.sync 0;" ::: "memory");
    if (V == 2) asm volatile("bar.sync 0;" ::: "memory");
    if (V == 3) asm volatile("barrier.sync 1, 256;" ::: "memory");
    if (V == 4) shared_sync0();
    if (V == 6) asm volatile("barrier.sync 0, 256;" ::: "memory");
    if (V == 7) { unsigned any; asm volatile("{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n barrier.red.or.pred q, 0, p;\n selp.u32 %0, 1, 0, q;\n}" : "=r"(any) : "r"((unsigned)(b > 1e9f)) : "memory"); b += any; }
    out[t] = b;
  }
  if (V == 5) asm volatile("barrier.sync 0;" ::: "memory");  // converged: one place for everyone
  out[256 + t] = s[255 - t];
}
#include <cstdlib>
int main(int argc, char** argv) {
  const int v = argc > 1 ? atoi(argv[1]) : 0;
  float* d; cudaMalloc(&d, 512 * sizeof(float));
  if (v == 1) probe<1><<<1, 256>>>(d);
  if (v == 2) probe<2><<<1, 256>>>(d);
  if (v == 3) probe<3><<<1, 256>>>(d);
  if (v == 4) probe<4><<<1, 256>>>(d);
  if (v == 5) probe<5><<<1, 256>>>(d);
  if (v == 6) probe<6><<<1, 256>>>(d);
  if (v == 7) probe<7><<<1, 256>>>(d);
  cudaError_t e = cudaDeviceSynchronize();
  printf("done: %s\n", cudaGetErrorString(e));
  return 0;
}
