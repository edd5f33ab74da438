#!/bin/bash
# GPT-2 (124M) on two nodes of 8 GPUs through MPI (-pm mpi): llm.c's multi-node recipe
# (2,097,152 tokens per step, one epoch of FineWeb 10B). mpich's mpiexec starts 8 processes on
# each host over ssh; each takes the GPU of its local rank.
# Needs on every node: this repository at the same path (or a shared file system), its Python
# packages, data/fineweb10B/ and data/hellaswag/, and passwordless ssh from the first node.
# Run on the first node: bash scripts/multi_node/run_gpt2_124M_mpi.sh
set -u

# ---- edit here ----------------------------------------------------------------
repo="$HOME/llm.cupy"                       # this repository, the same path on every node
hosts="node1:8,node2:8"                     # host:processes for each node (node1 runs rank 0)
processes=16                                # the sum of the above
out_dir="$repo/log_gpt2_124M_multi"         # checkpoints and main.log (rank 0 writes the model)
train_data="$repo/data/fineweb10B/fineweb_train_*.bin"
val_data="$repo/data/fineweb10B/fineweb_val_*.bin"
# export NCCL_SOCKET_IFNAME=eth0            # the network interface NCCL should use between nodes
# export NCCL_IB_DISABLE=0                  # InfiniBand where there is one
# export NCCL_DEBUG=INFO                    # when NCCL does not connect
# --------------------------------------------------------------------------------

cd "$repo" || exit 1
# shellcheck source=../gpt2_recipe.sh
source scripts/gpt2_recipe.sh               # GPT2_RECIPE: llm.c's flags
mpiexec -n "$processes" -hosts "$hosts" python gpt2_cuda.py "${GPT2_RECIPE[@]}" \
    -pm mpi \
    -i "$train_data" \
    -j "$val_data" \
    -o "$out_dir" \
    -e d12 -d 2097152 -l 0.0006 -s 20000 -n 1000
