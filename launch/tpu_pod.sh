#!/bin/bash
# Multi-host TPU VM slice: run the same command on every worker. JAX's Cloud TPU detection
# (jax.distributed.initialize()) finds the other hosts, so no coordinator is given.
#
# Variables a user sets:
#   TPU_NAME, ZONE, PROJECT   the TPU VM slice
#   BRORL_CONFIG, BRORL_WORKDIR (a gs:// bucket or shared mount), BRORL_MODEL, BRORL_DATA, BRORL_EVAL
#   BRORL_REPO                 path of this repository on the workers (copied there beforehand)
set -euo pipefail
: "${TPU_NAME:?}"; : "${ZONE:?}"; : "${PROJECT:?}"
: "${BRORL_CONFIG:=configs/brorl.py}"
: "${BRORL_WORKDIR:?}"; : "${BRORL_MODEL:?}"; : "${BRORL_DATA:?}"; : "${BRORL_EVAL:=}"
: "${BRORL_REPO:=~/brorl_jax}"

gcloud compute tpus tpu-vm ssh "${TPU_NAME}" --zone="${ZONE}" --project="${PROJECT}" --worker=all \
  --command="cd ${BRORL_REPO} && source .venv/bin/activate && \
    python -m brorl_jax.main --config=${BRORL_CONFIG} --workdir=${BRORL_WORKDIR} \
      --config.model.path=${BRORL_MODEL} --config.data.train=${BRORL_DATA} \
      --config.data.eval=${BRORL_EVAL} --config.mesh.data=-1 --config.mesh.fsdp=4"
