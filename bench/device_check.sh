#!/usr/bin/env bash
# One prepared GPU check (issue: GPU path). Run on the lent H200 through the device tool:
#   run(command="bash bench/device_check.sh", timeout_s=600)
# It uses the device image's python3 (which has jax with CUDA, flax, optax, orbax, triton,
# transformers, torch); packages the image lacks (grain, ml-collections, math-verify,
# reasoning-gym) are installed from wheels carried in .wheels/ when present:
#   here: pip download --no-deps -d .wheels grain ml-collections math-verify latex2sympy2_extended \
#         antlr4-python3-runtime==4.13.2 reasoning-gym array-record   (keep under 64 MiB)
# and pass carry=[".wheels"]. Writes everything under $OUT; prints a short table last.
# STATUS: prepared, never run (no session has had a GPU yet). Expect to fix things on first use.
set -uo pipefail
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
PY=${PY:-python3}
log() { echo "[device_check] $*" | tee -a "$OUT/summary.txt"; }

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
if [ -d .wheels ]; then
  $PY -m pip install --no-deps --no-index -q .wheels/*.whl > "$OUT/pip.txt" 2>&1 || log "wheel install had errors (see pip.txt)"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY -c "import jax; print(jax.devices())" > "$OUT/jax_devices.txt" 2>&1
log "devices: $(cat "$OUT/jax_devices.txt" | tail -1)"

# 1. Every kernel test, now compiled for the GPU (interpret mode is chosen from the backend).
timeout 240 $PY -m pytest -q -o addopts="" tests/kernels > "$OUT/kernel_tests.txt" 2>&1
log "kernel tests: $(tail -1 "$OUT/kernel_tests.txt")"

# 2. Fused log-prob at vocab 151,936, hidden 1536, bf16: naive vs chunked vs Pallas.
timeout 150 $PY bench/logprob.py --tokens 4096 16384 --dtype bfloat16 \
  --impls naive chunked pallas > "$OUT/logprob.txt" 2>&1
log "logprob bench: exit $?"

# 3. Update step at N in {16, 512} on a 1.5B-shaped model is the plan's job on a pod; on one
#    GPU we time the update of the small bench model at realistic batch sizes.
timeout 100 $PY bench/update.py --ns 16 512 --hidden 1536 --layers 4 --vocab 151936 --seq 256 \
  --micro 16 > "$OUT/update.txt" 2>&1
log "update bench: exit $?"

# 4. Rollout, N=16 vs N=512 at the same number of samples.
timeout 100 $PY bench/rollout.py --quick > "$OUT/rollout.txt" 2>&1
log "rollout bench: exit $?"

tail -n 25 "$OUT/logprob.txt" "$OUT/update.txt" "$OUT/rollout.txt" 2>/dev/null
cat "$OUT/summary.txt"
