#!/usr/bin/env bash
# Records the three CPU landscapes of the bundled workload (2 CPU ranks), each point measured 5 times
# (the replay scores against the median and hands out the recorded measurements as its noise).
# Rerunning resumes: points and repeats already in a landscape file are not run again.
set -euo pipefail
cd "$(dirname "$0")/.."
L=benchmarks/landscapes
C=benchmarks/configs
# cpu_gpt-0.9M_fast: also the points within 10% of the best median, to 40 draws each (~55 min in all)
python benchmarks/record.py $L/cpu_gpt-0.9M_fast.json --micro-batches 1,2,4,6,8,12,16,24,32 --repeats 6 --contenders 0.1 --contender-repeats 40 \
  -- config=$C/cpu_gpt-0.9M_fast.json launcher.num_gpus=2
python benchmarks/record.py $L/cpu_gpt-4M_fast.json --micro-batches 1,2,4,8,12,16,24,32 --repeats 5 \
  -- config=$C/cpu_gpt-4M_fast.json launcher.num_gpus=2 'script_args=--num_layers 4 --hidden_size 256 --seq_len 128'
python benchmarks/record.py $L/cpu_gpt-0.9M_full.json --micro-batches 1,4,8,16,24,32 --repeats 5 \
  -- config=$C/cpu_gpt-0.9M_full.json launcher.num_gpus=2 \
  '~space.zero1.allgather_bucket_size' 'space.zero1.reduce_bucket_size=[50000000,500000000]' \
  '~space.zero2.allgather_bucket_size' '~space.zero2.reduce_scatter' '~space.zero2.contiguous_gradients' \
  'space.zero2.reduce_bucket_size=[50000000,500000000]' \
  '~space.zero3.reduce_bucket_size' '~space.zero3.stage3_param_persistence_threshold'
