#!/usr/bin/env bash
# Rebuild the bundled demo checkpoints end to end (CPU, about an hour on 2 cores):
#   1. a token corpus sampled from the bundled stories260K model,
#   2. kimi-mini: a small DeepSeek-V3-architecture target trained on that corpus,
#   3. EAGLE-3 drafts for kimi-mini and for stories260K, trained on the targets' own responses.
# Usage: scripts/build_demo_pair.sh [work_dir]   (outputs go to checkpoints/, replacing the bundled ones:
# --overwrite; a run interrupted in a training step resumes it when started again with the same work_dir)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-.venv/bin/python}
WORK=${1:-/tmp/eagle3-demo-build}
mkdir -p "$WORK"

$PY scripts/make_corpus.py --model=checkpoints/stories260K --num_sequences=16384 --seq_len=128 \
    --temperature=1.0 --batch_size=512 --seed=0 --out="$WORK/corpus.npy" --overwrite

$PY scripts/train_target.py --config=checkpoints/kimi-mini.config.json --corpus="$WORK/corpus.npy" \
    --tokenizer_from=checkpoints/stories260K --epochs=1 --batch_size=16 --learning_rate=3e-3 --warmup_steps=50 \
    --seed=0 --ckpt_dir="$WORK/kimi-mini.ckpt" --out=checkpoints/kimi-mini --overwrite

$PY scripts/train_draft.py --target=checkpoints/kimi-mini --corpus="$WORK/corpus.npy" --prompt_len=8 \
    --num_prompts=3072 --max_tokens=120 --temperatures=0 --draft_vocab_size=0 --draft_intermediate_size=512 \
    --ttt_steps=7 --epochs=5 --batch_size=16 --learning_rate=3e-3 --warmup_steps=30 --compute_dtype=float32 \
    --mode=offline --feature_dir="$WORK/kimi-mini-features" --ckpt_dir="$WORK/kimi-mini-eagle3.ckpt" \
    --seed=0 --out=checkpoints/kimi-mini-eagle3 --overwrite

$PY scripts/train_draft.py --target=checkpoints/stories260K --corpus="$WORK/corpus.npy" --prompt_len=8 \
    --num_prompts=2048 --max_tokens=120 --temperatures=0 --draft_vocab_size=256 --draft_intermediate_size=256 \
    --ttt_steps=7 --epochs=6 --batch_size=16 --learning_rate=3e-3 --warmup_steps=30 --compute_dtype=float32 \
    --save_dtype=float32 --mode=online --ckpt_dir="$WORK/stories260K-eagle3.ckpt" --seed=0 \
    --out=checkpoints/stories260K-eagle3 --overwrite
