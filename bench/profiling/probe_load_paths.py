"""Scratch: how fast CTAs stream k and v into shared memory by three load paths, with the geometry
of the states pass at (1, 32, 16384, 128) bf16 (a CTA per head and segment of 4096 tokens, chunks
of 64 x 128, a ring of 2-4 stages, one barrier per chunk): cp.async by all 256 threads (padded
rows), one 16 KB bulk copy per tensor and chunk, and tensor copies (64 x 64 boxes, 128-byte
swizzle); optionally with a dependent FMA chain per chunk standing in for compute. Standalone
(CuPy and the driver through ctypes; nothing from rtkernels); prints a Markdown table of TB/s.

    python bench/profiling/probe_load_paths.py
"""
import ctypes, sys, cupy as cp, numpy as np
SRC = r'''
typedef unsigned int u32; typedef unsigned long long u64;
struct __align__(64) TMap { u64 v[16]; };
__device__ __forceinline__ u32 sa(const void* p){ return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(u32 b){ asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;"::"r"(b):"memory"); }
__device__ __forceinline__ void mbar_expect(u32 b,u32 n){ asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"::"r"(b),"r"(n):"memory"); }
__device__ __forceinline__ void mbar_wait(u32 b,u32 ph){ u32 d=0; do { asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0,1,0,p; }":"=r"(d):"r"(b),"r"(ph):"memory"); } while(!d); }
__device__ __forceinline__ void bulk1d(u32 dst,const void* src,u32 n,u32 b){ asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"::"r"(dst),"l"(src),"r"(n),"r"(b):"memory"); }
__device__ __forceinline__ void tma2d(u32 dst,const TMap* m,int c0,int c1,u32 b){ asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"::"r"(dst),"l"((u64)m),"r"(c0),"r"(c1),"r"(b):"memory"); }
__device__ __forceinline__ void cpa16(u32 d,const void* s){ asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"::"r"(d),"l"(s):"memory"); }

template<int MODE,int S>
__global__ void __launch_bounds__(256,1) probe(const unsigned short* k,const unsigned short* v,u32* out,int N,int seglen,int spin,
   const __grid_constant__ TMap mk,const __grid_constant__ TMap mv){
  extern __shared__ __align__(1024) unsigned char sm[];
  const int tid=threadIdx.x, h=blockIdx.x, s=blockIdx.y;
  const long row0=(long)h*N+(long)s*seglen;           // first row of this CTA
  const int nch=seglen/64;
  // stage layout: MODE 0 padded rows (136 el), MODE 1/2 dense 64x128 (16 KB) per tensor
  constexpr int TILE = MODE==0 ? 64*136*2 : 16384;
  constexpr int STG = 2*TILE;
  u32* bars=(u32*)(sm+S*STG);
  u32 acc=0; float f=tid;
  auto issue=[&](int c,int st){
    unsigned char* dk=sm+st*STG; unsigned char* dv=dk+TILE; long r=row0+(long)c*64;
    if(MODE==0){
      for(int e=tid;e<64*16;e+=256){ int rr=e>>4, cc=(e&15)*8;
        cpa16(sa(dk+(rr*136+cc)*2), k+(r+rr)*128+cc); cpa16(sa(dv+(rr*136+cc)*2), v+(r+rr)*128+cc); }
      asm volatile("cp.async.commit_group;":::"memory");
    } else if(tid==0){
      u32 b=sa(bars+2*st); mbar_expect(b,32768);
      if(MODE==1){ bulk1d(sa(dk),k+r*128,16384,b); bulk1d(sa(dv),v+r*128,16384,b); }
      else { tma2d(sa(dk),&mk,0,(int)r,b); tma2d(sa(dk+8192),&mk,64,(int)r,b); tma2d(sa(dv),&mv,0,(int)r,b); tma2d(sa(dv+8192),&mv,64,(int)r,b); }
    }
  };
  if(MODE!=0 && tid==0){ for(int i=0;i<S;++i) mbar_init(sa(bars+2*i)); asm volatile("fence.mbarrier_init.release.cluster;":::"memory"); }
  __syncthreads();
  for(int c=0;c<S-1;++c){ if(c<nch) issue(c,c); else if(MODE==0) asm volatile("cp.async.commit_group;":::"memory"); }
  for(int c=0;c<nch;++c){
    const int st=c%S;
    if(MODE==0){ asm volatile("cp.async.wait_group %0;"::"n"(S-2):"memory"); }
    else mbar_wait(sa(bars+2*st),(c/S)&1);
    __syncthreads();
    if(c+S-1<nch) issue(c+S-1,(c+S-1)%S); else if(MODE==0) asm volatile("cp.async.commit_group;":::"memory");
    const u32* t=(const u32*)(sm+st*STG);
    #pragma unroll
    for(int i=0;i<8;++i) acc^=t[tid*4+i*1024 % (TILE/2)];
    for(int i=0;i<spin;++i) f=fmaf(f,1.0001f,0.5f);
  }
  out[(blockIdx.y*gridDim.x+blockIdx.x)*256+tid]=acc+(u32)f;
}
'''
names=[f"probe<{m},{s}>" for m in (0,1,2) for s in (2,3,4)]
mod=cp.RawModule(code=SRC,options=("-std=c++17","-arch=sm_90a"),name_expressions=names)
lib=ctypes.CDLL("libcuda.so.1")
def tmap(ptr,rows):
    m=(ctypes.c_uint64*16)()
    dims=(ctypes.c_uint64*2)(128,rows); strides=(ctypes.c_uint64*1)(256)
    box=(ctypes.c_uint32*2)(64,64); es=(ctypes.c_uint32*2)(1,1)
    r=lib.cuTensorMapEncodeTiled(ctypes.byref(m),9,2,ctypes.c_void_p(ptr),dims,strides,box,es,0,3,2,0)
    assert r==0,r
    return np.frombuffer(bytes(m),dtype=np.uint64).copy()
H,N=32,16384
k=cp.random.randint(0,65535,(H*N*128,),dtype=cp.uint16); v=cp.random.randint(0,65535,(H*N*128,),dtype=cp.uint16)
out=cp.zeros(8*32*256*2,dtype=cp.uint32)
cp.cuda.Device(0).synchronize()
mk=tmap(k.data.ptr,H*N); mv=tmap(v.data.ptr,H*N)
MK=(ctypes.c_uint64*16)(*[int(x) for x in mk]); MV=(ctypes.c_uint64*16)(*[int(x) for x in mv])
lib.cuLaunchKernel.argtypes=[ctypes.c_void_p]+[ctypes.c_uint]*7+[ctypes.c_void_p]*3
def launch(f,grid,smem,seglen,spin):
    vals=[ctypes.c_uint64(k.data.ptr),ctypes.c_uint64(v.data.ptr),ctypes.c_uint64(out.data.ptr),ctypes.c_int32(N),ctypes.c_int32(seglen),ctypes.c_int32(spin),MK,MV]
    arr=(ctypes.c_void_p*8)(*[ctypes.cast(ctypes.pointer(x),ctypes.c_void_p) for x in vals])
    fp=f.kernel.ptr; r=lib.cuLaunchKernel(fp,grid[0],grid[1],1,256,1,1,smem,None,arr,None); assert r==0,r
ev0,ev1=cp.cuda.Event(),cp.cuda.Event()
print("| mode | stages | nseg | CTAs | spin | us | TB/s |\n|---|---|---|---|---|---|---|")
for nseg,seglen in ((3,4096),(4,4096),(8,2048)):
  for spin in (0,300):
    for m in (0,1,2):
      for s in (2,3,4):
        f=mod.get_function(f"probe<{m},{s}>")
        tile=64*136*2 if m==0 else 16384
        smem=s*2*tile+64+1024
        smem=max(smem,120*1024)
        f.max_dynamic_shared_size_bytes=smem
        for _ in range(3): launch(f,(H,nseg),smem,seglen,spin)
        ev0.record();
        for _ in range(20): launch(f,(H,nseg),smem,seglen,spin)
        ev1.record(); ev1.synchronize()
        us=cp.cuda.get_elapsed_time(ev0,ev1)/20*1000
        by=H*nseg*seglen*256*2
        print(f"| {['cp.async','bulk1d','tma'][m]} | {s} | {nseg} | {H*nseg} | {spin} | {us:.1f} | {by/us/1e6:.2f} |",flush=True)
