#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU, in one go: the CUDA tests, then the GPU benchmarks.
# Logs go to $OUT (or ./gpu_check_out). Run from the repository root:
#   bash benchmarks/gpu_check.sh tests   # the test suite, CUDA cases included
#   bash benchmarks/gpu_check.sh rope    # RoPE benchmark (copy ceiling, peers)
#   bash benchmarks/gpu_check.sh llama   # training step, generation, decode plan
#   bash benchmarks/gpu_check.sh bench   # rope + llama
#   bash benchmarks/gpu_check.sh         # everything
# Each of tests, rope and llama fits one 10-minute call of the device tool; bench and all may not.
# Without `pip install -e`, the checkout is put on PYTHONPATH. The RoPE peers Liger-Kernel and
# flash-attention (Triton code) are not on the lent GPU machines: `python benchmarks/gpu_peers.py`
# fetches them into .gpu_peers/ beforehand; carry that folder and they are put on PYTHONPATH.
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

{
  nvidia-smi -L
  python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" || true
} 2>&1 | tee "$out/env.log"

if [[ "$what" == all || "$what" == tests ]]; then
  # the whole suite: with a GPU the CUDA cases run instead of skipping (-rs lists any skip)
  timeout 480 python3 -m pytest tests -q -rs --tb=short -p no:cacheprovider 2>&1 \
    | tee "$out/tests.log" || status=1
fi
if [[ "$what" == all || "$what" == bench || "$what" == rope ]]; then
  timeout 300 python3 benchmarks/rope_cuda.py --json "$out/rope_cuda.json" 2>&1 \
    | tee "$out/rope_cuda.log" || status=1
fi
if [[ "$what" == all || "$what" == bench || "$what" == llama ]]; then
  timeout 200 python3 benchmarks/train_step_cuda.py --device CUDA:0 2>&1 \
    | tee "$out/train_step_cuda.log" || status=1
  timeout 200 python3 benchmarks/generate.py --device CUDA:0 2>&1 \
    | grep -v Writing | tee "$out/generate_cuda.log" || status=1
  timeout 120 python3 benchmarks/decode_plan.py --device CUDA:0 2>&1 \
    | tee "$out/decode_plan_cuda.log" || status=1
fi
exit $status
