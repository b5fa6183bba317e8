#!/bin/bash
# The GPU checks of docs/gpu.md in one command, for a GPU machine with torch, Triton and transformers
# but no network (the device tool's machines): pytest -m gpu; bench shapes at Llama-3.1-8B (no
# tiers, profiled; the captured question pre-pass beside the eager one), Qwen2.5-7B, the kernel
# sweep and the Llama tier arms, each while time is left of BUDGET seconds (default 520).
# Usage, from the checkout's root: bash scripts/gpu_checks.sh OUTDIR [gpu|cpu]
#   gpu: installs any wheels in .whl/ (packages the machine lacks: pydantic, pydantic-core,
#        annotated-types, typing-inspection, typing-extensions, faiss-cpu, gguf) into /tmp/site first.
#   cpu: the same steps at the tiny shape on the CPU (a dry run of the script itself, ~30 s).
# Runs from a copy of the tree in a temporary folder (the package's mapped folders linked in), so the
# checkout is left as it was.
set -u
OUT=${1:-$OUT}; MODE=${2:-gpu}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
if [ "$MODE" = gpu ]; then
  BUDGET=${BUDGET:-520}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  DEV=cuda; SHAPE=llama-3.1-8b; SHAPE2=qwen2.5-7b; EXTRA=""; CTX=4096,8192,16384; RATIOS=0.05,0.15,0.3
  PYTEST_SEL="tests/kernels tests/store tests/retrieval tests/bench tests/model tests/test_engine_cuda.py tests/test_engine_fidelity.py"
  PYTEST_MARK=gpu
else
  BUDGET=${BUDGET:-300}
  DEV=cpu; SHAPE=tiny; SHAPE2=tiny; EXTRA="--chunks 2,3 --chunk-tokens 40 --requests 2 --decode-tokens 4 --cache-gib 0.05"
  CTX=256; RATIOS=0.15
  PYTEST_SEL="tests/model/test_question_graph.py"; PYTEST_MARK="not gpu"
fi
OUT=$(cd "$OUT" && pwd)
TREE=$(mktemp -d)/tree && mkdir -p "$TREE"
tar --exclude=./.venv --exclude=./.git --exclude=./bench-out --exclude=./site --exclude=./build -cf - . | tar -xf - -C "$TREE"
cd "$TREE"
for d in kernels integrations pipelines; do ln -sfn ../$d cachedrag/$d; done  # setuptools' package-dir mapping
export PYTHONPATH=/tmp/site:$TREE:$TREE/benchmarks  # benchmarks/ holds cachedrag_bench (its own distribution)
{
  el env
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  python3 -c "import torch, triton, transformers, faiss; print(torch.__version__, triton.__version__, transformers.__version__, faiss.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" 2>&1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
el "pytest -m $PYTEST_MARK"
timeout 240 python3 -m pytest -m "$PYTEST_MARK" -q -p no:cacheprovider --timeout 150 $PYTEST_SEL > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; tail -25 "$OUT/pytest.log"
el "shapes $SHAPE --no-tiers --profile (left $(left)s)"
timeout $(( $(left) - 20 )) python3 -m cachedrag.cli bench shapes --shape $SHAPE --device $DEV --no-tiers --profile $EXTRA --json "$OUT/shapes-llama.json"
echo "shapes rc=$?"
if [ "$(left)" -gt 120 ]; then
  el "shapes $SHAPE2 (left $(left)s)"
  timeout $(( $(left) - 15 )) python3 -m cachedrag.cli bench shapes --shape $SHAPE2 --device $DEV --requests 3 --no-tiers --no-hf $EXTRA --json "$OUT/shapes-qwen.json"
  echo "qwen rc=$?"
fi
if [ "$(left)" -gt 80 ]; then
  el "kernels sweep (left $(left)s)"
  timeout $(( $(left) - 10 )) python3 scripts/kernels_sweep.py "$OUT/kernels.json" $DEV $CTX $RATIOS > "$OUT/kernels.log" 2>&1
  echo "kernels rc=$?"
fi
if [ "$(left)" -gt 120 ]; then
  el "shapes $SHAPE tiers (left $(left)s)"
  timeout $(( $(left) - 5 )) python3 -m cachedrag.cli bench shapes --shape $SHAPE --device $DEV --chunks 20 --requests 3 --no-hf $EXTRA --json "$OUT/shapes-tiers.json"
  echo "tiers rc=$?"
fi
el done
