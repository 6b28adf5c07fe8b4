#!/usr/bin/env bash
# Multi-node training under Slurm: one torchrun per node (c10d rendezvous on the first node), each
# starting one rank per GPU; together they run `mmrl train CONFIG` as one job of NODES x 8 ranks.
#
#   sbatch --nodes 4 scripts/slurm_train.sh configs/digit_sort_grpo.yaml train.steps=500
#   sbatch --nodes 2 scripts/slurm_train.sh CONFIG train.fsdp=true    # a model that does not fit one GPU
#
# The first argument is the config; every other argument is passed on as an override
# (key=value) or flag of `mmrl train`. Submit from the repository root (the job starts in the
# submission directory) with mmrl installed in .venv there, or in the environment the job inherits.
#
# What to change for your cluster:
#  * GPUs per node: --gpus-per-node below and GPUS_PER_NODE (the two must agree); --cpus-per-task
#    is the CPU cores of a node's whole task (all its ranks: ~8-16 per GPU leaves room for the
#    environment workers and data loading).
#  * The config: the first argument. train.prompts_per_step is per rank, so NODES x 8 ranks train
#    on NODES x 8 times the batch per step (README.md, Scaling).
#  * train.fsdp=true shards the policy (and its reference model) with FSDP2 over all ranks instead
#    of replicating it: use it when the model and its optimizer state do not fit one GPU.
#  * The partition, account and time limit your cluster asks for (#SBATCH --partition, --account).
#  * The rendezvous port (29500) if another job on the head node uses it.
#SBATCH --job-name=mmrl-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --time=24:00:00
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

if [ $# -lt 1 ]; then
  echo "usage: sbatch [--nodes N] scripts/slurm_train.sh CONFIG [key=value ...]" >&2
  exit 2
fi
CONFIG=$1
shift
GPUS_PER_NODE=8  # keep equal to --gpus-per-node above

cd "${SLURM_SUBMIT_DIR:-.}"
[ -f .venv/bin/activate ] && source .venv/bin/activate

# The first node of the allocation hosts the rendezvous.
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
echo "mmrl: $SLURM_NNODES nodes x $GPUS_PER_NODE GPUs, rendezvous at $HEAD:29500, config $CONFIG $*"

# One torchrun per node (--ntasks-per-node=1); the rendezvous gives each rank its global RANK.
srun torchrun --nnodes "$SLURM_NNODES" --nproc_per_node "$GPUS_PER_NODE" \
  --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d --rdzv_endpoint "$HEAD:29500" \
  -m mmrl.cli train "$CONFIG" "$@"
