#!/usr/bin/env bash
# POET pretraining on a SLURM cluster: one `accelerate launch` per node, FSDP2 across every GPU of every node.
#
#   sbatch examples/cluster/slurm_pretrain.sh --preset llama-1.3b --paper_steps --dataset allenai/c4 \
#       --dataset_config en --streaming --tokenizer_name t5-base --output_dir runs/llama-1.3b --save_steps 1000 \
#       --resume_from_checkpoint auto
#
# Every argument goes to scripts/pretrain.py. CONFIG picks another accelerate config (default: FSDP2 across nodes),
# GPUS_PER_NODE the processes per node. With --resume_from_checkpoint auto a requeued job continues from its newest
# complete checkpoint (scripts/pretrain.py writes them atomically). Node 0 is the rendezvous host; SLURM's
# variables give every node its rank.
#SBATCH --job-name=poet-pretrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=48:00:00
#SBATCH --requeue
#SBATCH --output=%x-%j.out
set -euo pipefail

REPO="${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
CONFIG="${CONFIG:-$REPO/examples/cluster/fsdp2_multinode.yaml}"
NODES="${SLURM_NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
HEAD_NODE="${HEAD_NODE:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" 2>/dev/null | head -n 1 || echo localhost)}"
PORT="${PORT:-29500}"

# One task per node; srun runs the launcher once on each, and each reads its own node rank from SLURM_NODEID.
srun --ntasks-per-node=1 bash -c "accelerate launch --config_file '$CONFIG' \
    --num_machines $NODES --num_processes $((NODES * GPUS_PER_NODE)) --machine_rank \$SLURM_NODEID \
    --main_process_ip '$HEAD_NODE' --main_process_port $PORT \
    '$REPO/scripts/pretrain.py' $(printf '%q ' "$@")"
