#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU: the CUDA tests, then the GPU benchmarks, stage by stage.
# The figures these print, with hardware and date: docs/performance.md. Run from the repository
# root; logs go to $OUT (default ./gpu_check_out), a file per stage:
#   bash benchmarks/gpu_check.sh                 # every stage, in this order
#   bash benchmarks/gpu_check.sh tests decode    # the stages named
# Stages:
#   tests    the suite, CUDA cases included (in parallel where pytest-xdist is installed)
#   decode   the decode products against cupy.matmul and a copy of the same bytes, then
#            generation of the ~100M and Llama-3.2-1B shapes in fp32 (decode against the
#            weight-streaming floor, prefill and decode against Hugging Face)
#   bf16     the BF16 targets: generation of the 1B shape (prefill B=8 prompt 512, decode B=1
#            and B=8), training steps of the medium and large models against torch autocast
#   memory   a 1B-shaped INFERENCE build: the CuPy pool against get_memory_stats, HF's peak
#   rope     RoPE against the copy ceiling and the peer libraries
#   train    the fp32 training step and the gradient all-reduce
#   serve    the server against stream_text on the GPU
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
stages=("$@")
(( ${#stages[@]} )) || stages=(tests decode bf16 memory rope train serve)
status=0
run() {  # run LOG COMMAND...: the command's output to the terminal and to $out/LOG
  local log="$1"
  shift
  echo "+ $*" | tee -a "$out/$log"
  "$@" 2>&1 | tee -a "$out/$log" || status=1
}

{
  nvidia-smi -L
  python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" || true
} 2>&1 | tee "$out/env.log"

for stage in "${stages[@]}"; do
  echo "== $stage at ${SECONDS}s"
  case "$stage" in
    tests)
      workers=()
      if python3 -c "import xdist" 2>/dev/null; then workers=(-n "$(( $(nproc) > 4 ? $(nproc) - 2 : 2 ))"); fi
      run tests.log python3 -m pytest tests -q -rs --tb=short --durations=10 -p no:cacheprovider \
        ${workers[@]+"${workers[@]}"} ;;
    decode)
      run decode.log python3 benchmarks/decode_products.py --device CUDA:0
      run decode.log python3 benchmarks/generate.py --device CUDA:0 --sizes ~100M 1B --repeat 1 ;;
    bf16)
      run bf16.log python3 benchmarks/generate.py --device CUDA:0 --sizes 1B --batch 1 8 --prompt 512 --precision bf16
      run bf16.log python3 benchmarks/train_step_cuda.py --device CUDA:0 --size medium --precision bf16
      run bf16.log python3 benchmarks/train_step_cuda.py --device CUDA:0 --size large --precision bf16 ;;
    memory)
      run memory.log python3 benchmarks/memory.py --device CUDA:0 ;;
    rope)
      run rope.log python3 benchmarks/rope_cuda.py --json "$out/rope_cuda.json" ;;
    train)
      run train.log python3 benchmarks/train_step_cuda.py --device CUDA:0 --size medium
      run train.log python3 benchmarks/allreduce.py --device CUDA:0 ;;
    serve)
      run serve.log python3 benchmarks/serve.py --device CUDA:0 ;;
    *)
      echo "gpu_check.sh: unknown stage '$stage' (tests, decode, bf16, memory, rope, train, serve)" >&2
      status=2 ;;
  esac
done
echo "== done at ${SECONDS}s"
exit $status
