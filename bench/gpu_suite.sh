#!/usr/bin/env bash
# The GPU test suite in shards that each finish inside a lent machine's per-command limit (about
# 10 minutes on one H100 with 16 workers), with one line per test so that a run cut short still
# names its failures. From the checkout's root:
#   bash bench/gpu_suite.sh SHARD [LOG_DIR]     SHARD: 1, 2, 3, 4 or slow
# Shard 4 holds the files whose time is not ours: fla's Triton compiles (its packed fp32 chunk
# backward alone took 98 s on an H100) and the two-process tests; put fla on PYTHONPATH for it.
# Compiles every kernel first when the cache is empty (RTKERNELS_CACHE_DIR, default /tmp/rtk_suite).
# WORKERS (default 16) sets pytest-xdist's worker count: shard 2's 4096-token dlog tests can run out
# of memory on an 80 GB card with 16 workers, and pass with 10.
set -u
shard=${1:?shard: 1, 2, 3, 4 or slow}
logs=${2:-.}
export RTKERNELS_CACHE_DIR=${RTKERNELS_CACHE_DIR:-/tmp/rtk_suite}
export RTKERNELS_TEST_CACHE_DIR=$RTKERNELS_CACHE_DIR
case $shard in
  1) files="methods variants_gamma decay_grad_f32 normalized decode fp32 limits nn compile_op property call_cache cached_grad compiled_call" ;;
  2) files="chunk_kernels dq_pass_dlog varlen" ;;
  3) files="decay_grad kernel_backward grad device_decay fused_dk_dv large_heads tensor_copies planned_backward dq_forward_states" ;;
  4) files="compat_fla two_devices pycuda" ;;
  slow) ;;
  *) echo "unknown shard $shard" >&2; exit 2 ;;
esac
[ -d "$RTKERNELS_CACHE_DIR/kernels" ] || python3 -m rtkernels compile --jobs 16 > "$logs/compile.log" 2>&1
if [ "$shard" = slow ]; then  # alone on the GPU: tensors of more than 2^31 elements
  python3 -m pytest tests -m slow -p no:xdist -p no:cacheprovider -v -rf --tb=short -W ignore > "$logs/suite-slow.log" 2>&1
else
  paths=$(for f in $files; do echo "tests/test_gpu_$f.py"; done)
  [ "$shard" = 4 ] && paths="$paths tests/test_distributed_cpu.py tests/test_compat.py"
  # shellcheck disable=SC2086
  python3 -m pytest $paths -m "gpu and not slow" -n "${WORKERS:-16}" -p no:cacheprovider -v -rf --tb=short -W ignore \
    > "$logs/suite-$shard.log" 2>&1
fi
rc=$?
grep -E "FAILED|ERROR" "$logs/suite-$shard.log" | head -40
tail -3 "$logs/suite-$shard.log"
exit $rc
