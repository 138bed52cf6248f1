# shellcheck shell=bash
# Sourced by the scripts/slurm/*.sbatch scripts: the NCCL environment, the torchrun rendezvous and
# the srun line that starts one container and one torchrun per node. Each torchrun then starts
# one process per GPU and sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, which
# is what `python -m megatron_zb.pretrain_gpt` and Megatron-LM's pretrain_gpt.py read.
#
# Environment (all optional):
#   MEGATRON_ZB_IMAGE    container image for pyxis (default megatron-zb:0.1.0, the tag the
#                        Dockerfile documents; on most clusters push it to a registry, or
#                        `enroot import -o megatron-zb.sqsh dockerd://megatron-zb:0.1.0` and
#                        give the .sqsh path)
#   CONTAINER_MOUNTS     pyxis --container-mounts (default: the submit directory on /workspace;
#                        add your data and checkpoint directories, comma-separated)
#   CONTAINER_WORKDIR    working directory in the container (default /workspace)
#   GPUS_PER_NODE        processes per node (default: Slurm's SLURM_GPUS_ON_NODE, else 8)
#   RDZV_HOST, RDZV_PORT rendezvous endpoint (default: the job's first node, port 29500)
#   NCCL_*               any NCCL setting you export wins over the defaults below
#   MEGATRON_ZB_DRY_RUN=1  print the srun command line instead of running it (no Slurm needed)
set -euo pipefail

MEGATRON_ZB_IMAGE=${MEGATRON_ZB_IMAGE:-megatron-zb:0.1.0}
CONTAINER_MOUNTS=${CONTAINER_MOUNTS:-"${SLURM_SUBMIT_DIR:-$PWD}:/workspace"}
CONTAINER_WORKDIR=${CONTAINER_WORKDIR:-/workspace}
NNODES=${SLURM_NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
RDZV_PORT=${RDZV_PORT:-29500}

# NCCL: InfiniBand on (set NCCL_IB_HCA to pick adapters, e.g. mlx5), sockets on every interface
# but loopback and docker's bridge (set NCCL_SOCKET_IFNAME to your fabric, e.g. ib0 or eth0).
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker0}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# A failed or hung collective aborts the job instead of blocking every rank forever.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# Megatron queues tensor/sequence-parallel communication in issue order only with one connection.
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# The host whose torchrun hosts the c10d rendezvous store: the job's first node, which is also
# where sbatch runs this script (hence the fallback to this host, e.g. for dry runs).
zb_head_node() {
  local nodes=()
  if [[ -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null; then
    mapfile -t nodes < <(scontrol show hostnames "${SLURM_JOB_NODELIST}" || true)
  fi
  echo "${nodes[0]:-${HOSTNAME:-localhost}}"
}
RDZV_HOST=${RDZV_HOST:-$(zb_head_node)}

# zb_launch ENTRY... -- TRAINING_FLAGS...: one container and one torchrun per node. ENTRY is what
# torchrun runs (`-m megatron_zb.pretrain_gpt` or a script path inside the container).
zb_launch() {
  local entry=()
  while [[ $# -gt 0 && "$1" != "--" ]]; do
    entry+=("$1")
    shift
  done
  if [[ $# -eq 0 ]]; then
    echo "zb_launch: usage: zb_launch ENTRY... -- TRAINING_FLAGS..." >&2
    return 2
  fi
  shift
  local cmd=(
    srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 --export=ALL
    --container-image="$MEGATRON_ZB_IMAGE"
    --container-mounts="$CONTAINER_MOUNTS"
    --container-workdir="$CONTAINER_WORKDIR"
    torchrun --nnodes="$NNODES" --nproc-per-node="$GPUS_PER_NODE"
    --rdzv-backend=c10d --rdzv-endpoint="$RDZV_HOST:$RDZV_PORT" --rdzv-id="${SLURM_JOB_ID:-megatron-zb}"
    "${entry[@]}" "$@"
  )
  if [[ "${MEGATRON_ZB_DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${cmd[@]}"
    echo
    return 0
  fi
  echo "megatron-zb: $NNODES node(s) x $GPUS_PER_NODE GPU(s), rendezvous $RDZV_HOST:$RDZV_PORT" >&2
  "${cmd[@]}"
}
