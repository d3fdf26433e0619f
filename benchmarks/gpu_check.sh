#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU, in one go: the CUDA tests, then the GPU benchmarks.
# The figures these print, with hardware and date: docs/performance.md.
# Logs go to $OUT (or ./gpu_check_out). Run from the repository root:
#   bash benchmarks/gpu_check.sh tests   # the test suite, CUDA cases included
#   bash benchmarks/gpu_check.sh rope    # RoPE benchmark (copy ceiling, peers)
#   bash benchmarks/gpu_check.sh llama   # training step, gradient all-reduce, generation, decode plan
#   bash benchmarks/gpu_check.sh bf16    # the BF16 targets: generation of the 1B shape (prefill
#                                        # B=8 prompt 512, decode B=1 and B=8 against HF sdpa and
#                                        # the floor), training steps of medium and large in BF16
#   bash benchmarks/gpu_check.sh bench   # rope + llama + bf16
#   bash benchmarks/gpu_check.sh         # everything
#   bash benchmarks/gpu_check.sh once    # everything, cut to end within ~560 s
# Each of tests, rope, llama and bf16 fits in 10 minutes; bench and all may not. `once` runs, in this
# order, each stage under its own timeout, the most important first:
#   the whole suite (in parallel over the machine's cores); RoPE without the torch.compile peer
#   in 5 interleaved rounds; the decode plan against the components' calls, at one position and
#   ragged (B=4); RoPE against the torch.compile peer alone; the training, all-reduce and
#   generation benchmarks on the time left.
# The whole call ends by ~560 s (GPU_CHECK_END=SECONDS ends it sooner: the later stages get what
# is left); logs stream to $OUT as they go, so a stage that runs out still leaves what it printed.
# Without `pip install -e`, the checkout is put on PYTHONPATH. The RoPE peers Liger-Kernel and
# flash-attention (Triton code) may be missing on a GPU machine that reaches no registry:
# `python benchmarks/gpu_peers.py` fetches them into .gpu_peers/ beforehand; copy that folder
# along and they are put on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [[ -d .gpu_peers/site ]]; then
  export PYTHONPATH="$PWD/.gpu_peers/site:$PYTHONPATH"
fi
what="${1:-all}"
status=0
if [[ "$what" == once ]]; then
  end="${GPU_CHECK_END:-560}"  # seconds: where the call must end (the variable shortens it)
  t_tests=170 t_rope=100 t_compile=150 t_train=50 t_ar=30 t_gen=140 t_plan=30
  rope_args=(--no-compile --rounds 5 --repeats 3)  # ~60 s: 69 figures a round (3 peers)
  gen_args=(--repeat 1)
  plan_args=(--steps 100 --rounds 3)
else
  end=560
  t_tests=480 t_rope=300 t_compile=0 t_train=200 t_ar=120 t_gen=200 t_plan=120
  t_bf16_gen=240 t_bf16_train=150  # each of the two training sizes
  rope_args=() gen_args=() plan_args=()
fi
mark() { echo "== $1 at ${SECONDS}s"; }
stage() { [[ "$what" == all || "$what" == once || "$what" == "$1" || ( "$what" == bench && "$1" != tests ) ]]; }

{
  nvidia-smi -L
  python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" || true
} 2>&1 | tee "$out/env.log"

if stage tests; then
  mark tests
  # the whole suite: with a GPU the CUDA cases run instead of skipping (-rs lists any skip)
  # in parallel where pytest-xdist is installed: serially the suite takes over 270 s with its
  # CUDA cases, ~85 s on 14 workers
  workers=()
  if python3 -c "import xdist" 2>/dev/null; then workers=(-n "$(( $(nproc) > 4 ? $(nproc) - 2 : 2 ))"); fi
  timeout -k 10 "$t_tests" python3 -m pytest tests -q -rs --tb=short --durations=10 -p no:cacheprovider \
    ${workers[@]+"${workers[@]}"} 2>&1 \
    | tee "$out/tests.log" || status=1
fi
if stage rope; then
  mark rope
  timeout -k 10 "$t_rope" python3 benchmarks/rope_cuda.py ${rope_args[@]+"${rope_args[@]}"} --json "$out/rope_cuda.json" 2>&1 \
    | tee "$out/rope_cuda.log" || status=1
fi
if [[ "$what" == once ]]; then
  # the decode plan against the components' calls, at one position and ragged (B=4), before
  # the optional stages
  mark plan
  timeout -k 10 "$t_plan" python3 benchmarks/decode_plan.py --device CUDA:0 ${plan_args[@]+"${plan_args[@]}"} 2>&1 \
    | tee -a "$out/rope_cuda.log" || status=1
  mark "plan ragged"
  timeout -k 10 "$t_plan" python3 benchmarks/decode_plan.py --device CUDA:0 --batch 4 --ragged \
    ${plan_args[@]+"${plan_args[@]}"} 2>&1 | tee -a "$out/rope_cuda.log" || status=1
fi
left() { echo $(( end - SECONDS )); }
if [[ "$what" == once ]] && (( $(left) > 40 )); then
  # RoPE against the torch.compile peer alone (it compiles a graph per shape and dtype while
  # the cases are set up, a line each; the table prints after every round); `all` and `rope`
  # time it with the other peers
  mark compile
  (( $(left) < t_compile )) && t_compile=$(left)
  timeout -k 10 "$t_compile" python3 benchmarks/rope_cuda.py --rounds 3 --repeats 4 --peer "HF compile" 2>&1 \
    | tee "$out/rope_compile.log" || status=1
fi
if stage llama && { [[ "$what" != once ]] || (( $(left) > 120 )); }; then
  mark llama
  if [[ "$what" == once ]]; then  # the time left, shared in the proportions of the timeouts
    share=$(( $(left) - 40 ))  # each stage's kill may add its 10 s
    t_train=$(( share * t_train / 220 )) t_ar=$(( share * t_ar / 220 )) t_gen=$(( share * t_gen / 220 ))
  fi
  timeout -k 10 "$t_train" python3 benchmarks/train_step_cuda.py --device CUDA:0 2>&1 \
    | tee "$out/llama.log" || status=1
  # the gradient all-reduce on one GPU: NCCL over a one-rank world (backend="nccl")
  timeout -k 10 "$t_ar" python3 benchmarks/allreduce.py --device CUDA:0 2>&1 \
    | tee -a "$out/llama.log" || status=1
  timeout -k 10 "$t_gen" python3 benchmarks/generate.py --device CUDA:0 ${gen_args[@]+"${gen_args[@]}"} 2>&1 \
    | grep -v Writing | tee -a "$out/llama.log" || status=1
  if [[ "$what" != once ]]; then  # `once` ran it after the RoPE benchmark
    timeout -k 10 "$t_plan" python3 benchmarks/decode_plan.py --device CUDA:0 ${plan_args[@]+"${plan_args[@]}"} 2>&1 \
      | tee -a "$out/llama.log" || status=1
  fi
fi
if [[ "$what" == bf16 || "$what" == bench || "$what" == all ]]; then
  mark bf16
  timeout -k 10 "$t_bf16_gen" python3 benchmarks/generate.py --device CUDA:0 --sizes 1B --batch 1 8 \
    --prompt 512 --precision bf16 2>&1 | grep -v Writing | tee "$out/bf16.log" || status=1
  for size in medium large; do
    timeout -k 10 "$t_bf16_train" python3 benchmarks/train_step_cuda.py --device CUDA:0 --size "$size" \
      --precision bf16 2>&1 | tee -a "$out/bf16.log" || status=1
  done
fi
mark done
exit $status
