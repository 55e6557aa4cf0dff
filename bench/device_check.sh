#!/usr/bin/env bash
# One prepared GPU check (issues 19, 25, 41): the decode loop (bf16 and fp8) and the packed update
# against their rooflines and the compiled kernels against their references, in one short run (< 10 min on an
# H100/H200); FULL=1 adds the kernels' speed against the XLA paths and the CPU benches' GPU runs. Run it on a lent GPU
# through the device tool:
#   run(command="bash bench/device_check.sh", timeout_s=600)
# It uses the device image's python3 (jax with CUDA, triton, flax, optax, ...). Packages the
# image lacks are installed from wheels carried in .wheels/ when present (no network there):
#   here: pip download --no-deps -d .wheels jax-triton==0.3.1 grain ml-collections math-verify \
#         latex2sympy2_extended antlr4-python3-runtime==4.13.2 reasoning-gym array-record
#   and pass carry=[".wheels"] (keep it under 64 MiB).
# Writes under $OUT (at most 8 files come back): summary.txt, env.txt, decode_roofline.txt/.json,
# update_roofline.txt, kernel_tests.txt; with FULL=1 also kernel_check.md, logprob.txt,
# update.txt, rollout.txt.
# Each step is logged before it runs; a failing step is recorded and the next one still runs;
# the exit status is non-zero if any step failed.
set -euo pipefail
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
FAILED=0
log() { echo "[device_check] $*" | tee -a "$OUT/summary.txt"; }
step() {  # step NAME TIMEOUT_S OUTFILE CMD...
  local name=$1 limit=$2 outfile=$3; shift 3
  log "RUN  $name: $* (timeout ${limit}s, output $outfile)"
  local t0=$SECONDS rc=0
  timeout "$limit" "$@" > "$OUT/$outfile" 2>&1 || rc=$?
  if [ "$rc" -eq 0 ]; then
    log "OK   $name ($((SECONDS - t0)) s): $(tail -n 1 "$OUT/$outfile")"
  else
    FAILED=1
    log "FAIL $name (exit $rc, $((SECONDS - t0)) s): $(tail -n 3 "$OUT/$outfile" | tr '\n' ' ')"
  fi
}

{
  nvidia-smi || true
  $PY -c "import jax; print(jax.__version__, jax.devices())"
  $PY -m pip list 2>/dev/null | grep -i -E "^(jax|jaxlib|jax-cuda|jax-triton|triton|flax) " || true
} > "$OUT/env.txt" 2>&1 || true
if [ -d .wheels ]; then
  log "installing carried wheels: $(ls .wheels | tr '\n' ' ')"
  $PY -m pip install --no-deps --no-index -q .wheels/*.whl >> "$OUT/env.txt" 2>&1 \
    || log "wheel install had errors (see env.txt)"
fi
log "devices: $($PY -c 'import jax; print(jax.devices())' 2>&1 | tail -n 1)"

# 0. The decode loop at the floor (issue 25): 256 slots of one 1024-token prompt on Qwen2.5-1.5B
#    shapes (random weights, no stop token, 3072 new tokens: mean context 2560), timed, next
#    to the bytes per step bench/roofline.py's walker predicts for the same program compiled for
#    this GPU: achieved bytes/s against the HBM bandwidth, tokens/s against the roofline's.
#    Issue 41: once with bf16 weights and KV, then with fp8 (e4m3) weights and KV, in the same
#    process; the last line is the fp8 / bf16 ratio of step time and tokens/s, measured side by
#    side (bf16: two compiles + ~1 min of decoding; fp8: the same at about half the bytes).
step decode_roofline 330 decode_roofline.txt $PY bench/roofline.py --measure-device --slots 256 \
  --precisions ${DECODE_PRECISIONS:-bf16 fp8} --json "$OUT/decode_roofline.json"
# 0b. The update at the floor (issue 25): 8 packed rows x 2048 tokens on Qwen2.5-1.5B shapes
#    (random weights, float32 master weights, bf16 compute), timed, achieved MFU next to the
#    ceiling bench/_roofline_update.py predicts for the same compiled program.
step update_roofline 150 update_roofline.txt $PY bench/device_update_check.py
# 1. The kernel tests, now compiled for the GPU (interpret mode follows the backend; the Mosaic
#    family's tests skip there; the jax_triton numerics test runs if jax_triton imports).
#    Steps 0, 0b and 1 are the default run: their timeouts add up to 9 min 20 s
#    (DECODE_PRECISIONS=bf16: 7 min 50 s, step 0 without the fp8 timing).
step kernel_tests 80 kernel_tests.txt $PY -m pytest -q -o addopts="" -rs tests/kernels
if [ "${FULL:-0}" = "1" ]; then
  # 2. Numerics and speed at the paper's shapes: sampling [512, 151936] (reference / pallas /
  #    jax_triton), fused log-prob fwd+bwd (naive / chunked / pallas) at 1.5B and 8B widths.
  step kernel_check 90 kernel_check.log $PY bench/kernel_check.py --out "$OUT/kernel_check.md"
  # 3. The log-prob bench (separate processes, peak memory) at vocab 151,936, bf16.
  step logprob_bench 50 logprob.txt $PY bench/logprob.py --tokens 4096 16384 --dtype bfloat16 \
    --impls naive chunked pallas
  step update_bench 100 update.txt $PY bench/update.py --ns 16 512 --hidden 1536 --layers 4 \
    --vocab 151936 --seq 256 --micro 16
  step rollout_bench 100 rollout.txt $PY bench/rollout.py --quick
fi
tail -n 1 "$OUT/decode_roofline.txt" 2>/dev/null || true
cat "$OUT/kernel_check.md" 2>/dev/null || true
cat "$OUT/summary.txt"
exit $FAILED
