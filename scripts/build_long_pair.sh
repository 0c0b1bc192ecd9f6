#!/usr/bin/env bash
# A pair that speculates at length, rebuilt end to end (CPU, about 3 hours on 2 cores: the target's ~250 steps at 2K
# about 5 s each (at 4K: 30-45 s and 11 GB), each draft about 40 minutes):
#   1. the target: kimi-mini with its YaRN extended to 8,192 positions, trained further at 2K on the
#      stories260K-sampled corpus's rows laid end to end (train_target.py --init_from the bundled kimi-mini),
#      so that it writes text at length (YaRN alone at factor 64 gives letter soup past a few hundred tokens);
#   2. three EAGLE-3 drafts for it trained on its own greedy text: 40 GSM8K questions, each continued
#      4,000 tokens past end-of-sequence (contexts up to 4K), the training-time test over whole sequences:
#      plain EAGLE-3, EAGLE 3.1 (--fc_norm --norm_output) and a 256-token sliding window (the responses
#      regenerated once, in $WORK/regenerated.npz, for all three);
#   3. each draft's chain 3:1:4 acceptance at 256, 1K, 2K and 4K tokens of context, on the target's own
#      text after held-out questions (benchmarks/results/long-pair-tau-<variant>.json).
# Usage: scripts/build_long_pair.sh [work_dir] [variants]   (default /tmp/long-pair, "plain eagle3.1 sliding";
# the bundled demo pair is not touched; a run interrupted in training resumes with the same work_dir)
set -euo pipefail
case ${1:-} in -h|--help) sed -n '2,14p' "$0"; exit 0 ;; esac
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-.venv/bin/python}
WORK=${1:-/tmp/long-pair}
VARIANTS=${2:-plain eagle3.1 sliding}
mkdir -p "$WORK"

[ -d "$WORK/kimi-mini-8k-yarn" ] || $PY benchmarks/harness/long-context.py --positions=8192 --pair_dir="$WORK/kimi-mini-8k-yarn"
[ -f "$WORK/stories-2k.npy" ] || {
  $PY scripts/make_corpus.py --model=checkpoints/stories260K --num_sequences=4096 --seq_len=128 --temperature=1.0 \
      --batch_size=512 --seed=0 --out="$WORK/stories.npy" --overwrite
  $PY -c "import numpy as np, sys; np.save(sys.argv[2], np.load(sys.argv[1]).reshape(-1, 2048))" \
      "$WORK/stories.npy" "$WORK/stories-2k.npy"
}
$PY scripts/train_target.py --config="$WORK/kimi-mini-8k-yarn/config.json" --corpus="$WORK/stories-2k.npy" \
    --init_from=checkpoints/kimi-mini --tokenizer_from=checkpoints/kimi-mini --epochs=1 --batch_size=1 \
    --learning_rate=1e-3 --warmup_steps=10 --ckpt_dir="$WORK/kimi-mini-8k.ckpt" --out="$WORK/kimi-mini-8k"

for variant in $VARIANTS; do
  case $variant in
    plain) switches=() ;;
    eagle3.1) switches=(--fc_norm --norm_output) ;;
    sliding) switches=(--sliding_window=256) ;;
    *) echo "unknown variant $variant (plain, eagle3.1, sliding)" >&2; exit 2 ;;
  esac
  $PY scripts/train_draft.py --target="$WORK/kimi-mini-8k" --prompts=data/gsm8k/test_full.jsonl --num_prompts=40 \
      --max_tokens=4000 --ignore_eos --temperatures=0 --gen_batch_size=40 --draft_intermediate_size=512 \
      --ttt_steps=5 --epochs=3 --batch_size=1 --learning_rate=3e-3 --warmup_steps=10 "${switches[@]}" \
      --regenerated="$WORK/regenerated.npz" --ckpt_dir="$WORK/draft-$variant.ckpt" --out="$WORK/draft-$variant"
  $PY benchmarks/harness/long-context.py --target="$WORK/kimi-mini-8k" --draft="$WORK/draft-$variant" --text=own \
      --spec=chain:3:1:4 --contexts=256,1024,2048,4096 --batch=4 \
      --json_out="benchmarks/results/long-pair-tau-$variant.json" --overwrite
done
