#!/usr/bin/env bash
# Plants a wrong chunk carry (gamma^(len+1) instead of gamma^len) into a scratch copy of one kernel
# at a time and runs the wrong-power tests against it: each mutant must make tests fail. The
# repository's sources are never touched (docs/testing.md, "Planted mutants").
#   bench/profiling/plant_mutants.sh [pytest args...]     (on a GPU machine, from the repo root)
set -uo pipefail
root=$(pwd)
scratch=$(mktemp -d)
tests=${*:-tests/test_gpu_variants_gamma.py}
declare -A mutants=(
  [fwd16]='cuda_src/chunk/fwd16.cu|rtk_exp2(lg2 \* (float)len)|rtk_exp2(lg2 * (float)(len + 1))'
  [fwd_f32]='cuda_src/chunk/fwd_f32.cu|(double)lgd \* (double)len)|(double)lgd * (double)(len + 1))'
  [fwd_f32_full]='cuda_src/chunk/fwd_f32.cu|(double)lgd \* (double)C)|(double)lgd * (double)(C + 1))'
  [states]='cuda_src/chunk/states.cu|rtk_exp2(lg2 \* (float)len)|rtk_exp2(lg2 * (float)(len + 1))'
  [decay_grad]='cuda_src/chunk/decay_grad.cu|exp2((double)lg2 \* (double)len)|exp2((double)lg2 * (double)(len + 1))'
)
run() {  # the pytest summary line of the tests on the scratch copy (one kernel cache: a mutated
        # source has its own keys, the others are compiled once)
  (cd "$scratch" && PYTHONPATH="$scratch:${PYTHONPATH:-}" RTKERNELS_TEST_CACHE_DIR="$scratch/cache" python3 -m pytest -q -m gpu -p no:cacheprovider $tests 2>&1 | tail -1)
}
cp -r "$root/rtkernels" "$root/cuda_src" "$root/tests" "$root/pyproject.toml" "$scratch/"
echo "baseline: $(run)"
for name in "${!mutants[@]}"; do
  IFS='|' read -r file from to <<<"${mutants[$name]}"
  cp "$root/$file" "$scratch/$file"
  n=$(grep -c "$from" "$scratch/$file")
  sed -i "s/$from/$to/" "$scratch/$file"
  echo "$name ($file, $n line(s) planted): $(run)"
  cp "$root/$file" "$scratch/$file"
done
rm -rf "$scratch"
