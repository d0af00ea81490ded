#!/usr/bin/env bash
# On the GPU machine (no package index): install the carried peers into /tmp/peers, once.
#   .peers/ holds what ../shared/tools/peer-wheels.sh downloads (+ nvidia-ml-py, matplotlib wheels).
# Usage: source bench/setup_peers.sh   (exports PYTHONPATH)
set -u
if [ ! -d /tmp/peers/fla ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peers $(ls .peers/*.whl .whl/*.whl 2>/dev/null)
fi
if [ ! -d /tmp/peers/pycuda ] && ls .peers/pycuda-*.tar.gz >/dev/null 2>&1; then
  (rm -rf /tmp/pycuda-src && mkdir -p /tmp/pycuda-src && tar xzf .peers/pycuda-*.tar.gz -C /tmp/pycuda-src \
   && cd /tmp/pycuda-src/pycuda-* \
   && python3 configure.py --cuda-root=/usr/local/cuda --cudadrv-lib-dir=/usr/local/cuda/lib64/stubs >/dev/null \
   && MAKEFLAGS=-j16 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/peers . ) \
   || echo "pycuda build failed: LeetDecoding will be reported as not importable"
fi
if [ ! -d /tmp/peers/leetDecoding ] && ls .peers/leetDecoding-*.tar.gz >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/peers .peers/leetDecoding-*.tar.gz \
   || echo "leetDecoding install failed"
fi
export PYTHONPATH=/tmp/peers:$PWD
