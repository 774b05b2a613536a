#!/usr/bin/env bash
# The runs of docs/benchmarks/gpu-run.md on whatever GPUs this machine has, in parts that each
# fit one 10-minute command (every run has its own time limit, so one that fails or hangs does
# not hide the others; the limits within a part add up to under 10 minutes):
#
# - throughput: README's command, then the step times at 124M (stages 0 and 3, and stage 0
#   with the layer loop unrolled, side by side) and 1.3B (stages 0, 3 and 3 by module) beside
#   their estimates: the figures of the throughput targets (docs/benchmarks/gpu-run.md);
# - offload: every offload layout (tiny, with deterministic GPU kernels and SGD, so that losses
#   compare), offload's step time at 124M with AdamW and with SGD;
# - tiers: per-block stage 3 on an unrolled GPT-2 beside its peers, the NVMe tier's bandwidth;
# - several (on more than one GPU): the stages' step times at 124M and zero_jax beside the
#   GSPMD baseline with tensor parallelism (what the CPU mesh cannot time).
#
# Results go to DIR (default gpu-run/).
#
#     bash bench/gpu_run.sh [DIR] [throughput|offload|tiers|several|all]    # default: all
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-run}
part=${2:-all}
case $part in
    throughput|offload|tiers|several|all) ;;
    *) echo "error: the part must be throughput, offload, tiers, several or all (got $part)" >&2
       exit 2;;
esac
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$out/devices.txt"
quiet() { grep -v -E "^[WI][0-9]{4}"; }  # without XLA's log lines
tables() { grep -E "^\||failed|config"; }

throughput() {
    timeout 100 python3 train.py --stage 3 > "$out/train.log" 2>&1
    tail -1 "$out/train.log"
    timeout 240 python3 bench/gpu.py --devices 1 --runs '0;3;0, unrolled' --steps 5 \
        --rounds 3 --set train.batch_size=32 --json "$out/estimate-1gpu.json" 2>&1 | quiet \
        | tee "$out/estimate-1gpu.md"
    timeout 200 python3 bench/gpu.py --config gpt-1.3b --devices 1 \
        --runs '0;3;3, by module' --steps 4 --rounds 3 --set train.batch_size=16 \
        --json "$out/1.3b-1gpu.json" 2>&1 | quiet | tee "$out/1.3b-1gpu.md"
}

offload() {
    XLA_FLAGS=--xla_gpu_exclude_nondeterministic_ops=true timeout 120 python3 bench/offload.py \
        --stages 0,3 --steps 2 --rounds 1 --set optimizer.name=sgd 2>&1 | tables \
        | tee "$out/offload-tiny-sgd.md"
    timeout 240 python3 bench/offload.py --config gpt2-124m --stages 0,3 --steps 4 --rounds 2 \
        --set train.batch_size=32 2>&1 | tables | tee "$out/offload-124m.md"
    timeout 150 python3 bench/offload.py --config gpt2-124m --stages 0 --steps 4 --rounds 2 \
        --set train.batch_size=32 --set optimizer.name=sgd 2>&1 | tables \
        | tee "$out/offload-124m-sgd.md"
}

tiers() {
    timeout 330 python3 bench/peers.py --model unrolled --config gpt2-124m --rounds 1 \
        --steps 3 --set train.batch_size=16 2>&1 | grep -E "^\||config" \
        | tee "$out/peers-unrolled-124m.md"
    # From 31 layers (--params-m 32) the gradient program fails in XLA's GPU layout
    # assignment (jax 0.11.2, docs/benchmarks/gpu-run.md); the whole log is kept.
    for m in 24 32; do
        mkdir -p "$out/nvme$m"
        timeout 90 python3 bench/nvme.py --path "$out/nvme$m" --params-m $m --rounds 3 \
            > "$out/nvme$m.log" 2>&1
        grep -E "^\||parameters,|INTERNAL" "$out/nvme$m.log" | cut -c1-200
        rm -rf "$out/nvme$m"
    done
}

several() {
    if [ "$(python3 -c 'import jax; print(jax.device_count())')" -le 1 ]; then
        echo "one GPU: nothing to run for the part 'several'"
        return
    fi
    timeout 280 python3 bench/gpu.py --steps 5 --rounds 3 --json "$out/stages.json" 2>&1 \
        | quiet | tee "$out/stages.md"
    timeout 280 python3 bench/peers.py --config gpt2-124m --rounds 3 --steps 5 \
        --set mesh.tensor_parallel=2 2>&1 | grep -E "^\||config" | tee "$out/peers-tp2.md"
}

if [ "$part" = all ]; then
    throughput; offload; tiers; several
else
    "$part"
fi
