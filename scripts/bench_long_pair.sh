#!/usr/bin/env bash
# Speculation against context on the pair that holds at length (scripts/build_long_pair.sh builds it):
#   1. AMD's measure: the target's verify ms per accepted token against the context (256 to 4K), plain,
#      chain 3:1:4 and tree 5:4:16, with tau (benchmarks/results/long-pair-verify-cost.json);
#   2. the field's scenarios scaled to a CPU, plain vs chain vs tree vs auto, 3 interleaved repeats each:
#      2,048 in / 256 out and 256 in / 2,048 out (random tokens) at concurrency 1 and 2, and the agent
#      trace (8 sessions x 4 turns of growing contexts, prefix caching) at concurrency 1 and 4
#      (benchmarks/results/long-pair-{2048-256,256-2048,agentic}.*);
#   3. the same two random shapes at concurrency 1, paired round by round, A B C C B A (a pass of bench.py is too long
#      to resolve 5-10 % on a shared host): plain vs chain 3:1:4 vs auto (long-pair-ab-<variant>-*.json).
# Float32, greedy, in process; run it with nothing else on the machine (the timings are the result).
# Usage: scripts/bench_long_pair.sh [work_dir] [variant]   (default /tmp/long-pair, the plain draft)
set -euo pipefail
case ${1:-} in -h|--help) sed -n '2,12p' "$0"; exit 0 ;; esac
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-.venv/bin/python}
WORK=${1:-/tmp/long-pair}
VARIANT=${2:-plain}
TARGET=$WORK/kimi-mini-8k
DRAFT=$WORK/draft-$VARIANT
for need in "$TARGET" "$DRAFT"; do
  [ -d "$need" ] || { echo "$need is missing: run scripts/build_long_pair.sh $WORK first" >&2; exit 2; }
done
OUT=benchmarks/results

$PY benchmarks/harness/long-context.py --target="$TARGET" --draft="$DRAFT" --text=own \
    --spec=none,chain:3:1:4,tree:5:4:16 --contexts=256,1024,2048,4096 --batch=4 \
    --json_out="$OUT/long-pair-verify-cost.json" --overwrite
BENCH=($PY scripts/bench.py --target="$TARGET" --draft="$DRAFT" --spec=none,chain:3:1:4,tree:5:4:16,auto
       --repeats=3 --interleave --out_dir="$OUT" --overwrite)
"${BENCH[@]}" --workload=random --shape=8k1k --scale=0.25 --concurrency=1,2 --num_prompts=8 --num_warmups=2 \
    --name=long-pair-2048-256
"${BENCH[@]}" --workload=random --shape=1k8k --scale=0.25 --concurrency=1,2 --num_prompts=4 --num_warmups=2 \
    --name=long-pair-256-2048
"${BENCH[@]}" --workload=agentic --output_len=64 --concurrency=1,4 --num_prompts=32 --num_warmups=4 \
    --prefix_caching --num_pages=2048 --name=long-pair-agentic
AB=($PY benchmarks/harness/long-pair-ab.py --target="$TARGET" --draft="$DRAFT" --specs=none,chain:3:1:4,auto --overwrite)
"${AB[@]}" --rounds=8 --json_out="$OUT/long-pair-ab-$VARIANT-2048-256.json"
"${AB[@]}" --rounds=6 --input_len=256 --output_len=2048 --json_out="$OUT/long-pair-ab-$VARIANT-256-2048.json"
