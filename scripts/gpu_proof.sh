#!/usr/bin/env bash
# The GPU proof in one call: scripts/gpu_check.py's parts and the step accounting with the kernels,
# each in its own process under its own time limit, each writing its JSON as it finishes, so a
# part cut short loses only itself. Everything lands in OUT_DIR: run.log and one JSON per part.
#
#   scripts/gpu_proof.sh OUT_DIR [PART ...]     # on a GPU; PART: kernels demo step-triton steps step-xla
#                                               # (or mla-tensor / mla-data: Kimi-K2.5's MLA attention per
#                                               # device in the tensor-parallel layout, 8 heads at batch 64,
#                                               # and the data-parallel one, 64 heads at batch 8, at 2K, 8K
#                                               # and 32K context, T = 1 and 4; moe-kimi: the int4 MoE at 8,
#                                               # 40, 64, 160 and 256 tokens over 48 of 384 experts;
#                                               # attention: the MLA attention rows alone; gqa: GQA's,
#                                               # 64 query heads over 8 KV heads of 128; sweep: the MLA
#                                               # rows over SWEEP_LAUNCHES at SWEEP_PAGE-slot pages, default
#                                               # 64; step-auto; moe-mini / moe-mid: the MoE rows on
#                                               # kimi-mini's bfloat16 experts / 2048 x 768 ones, 128 of them;
#                                               # host: the scheduler's host ms per iteration and its phases,
#                                               # scripts/bench_host.py at HOST_SEQS sequences, default 1,8,48;
#                                               # host-standin: the same with the programs stood in, the
#                                               # scheduler's own host work, at STANDIN_SEQS, default 1,64,256;
#                                               # sampling: a sampled draw with temperature alone against
#                                               # top-p, benchmarks/harness/sampling-sort-ab.py)
#   SMALL=1 scripts/gpu_proof.sh /tmp/proof     # the rehearsal on a CPU host (small shapes, interpreted)
#
# Time limits per part, in seconds, from the environment: KERNELS_S (also attention, gqa, sweep),
# DEMO_S, STEP_S, STEPS_S, MOE_S, HOST_S, SAMPLING_S (defaults below: about 8 minutes for the five default parts).
# STEP_BATCHES and STEP_SPECS set the step accounting's batches and settings (default 1,8 and
# none,chain:3:1:4,tree:5:4:16); STEP_SHAPES the steps part's batch:T pairs (e.g. 64:4); DEMO_FLAGS
# adds flags to the demo part (e.g. --demo_kernels=triton). Budget the limits by the programs a part
# compiles (the Pallas-era step programs took 30-60 s each on an H200). Run from the repository root, with
# the project's dependencies importable (a machine without llguidance needs its wheel installed first).
set -u
out=${1:?usage: scripts/gpu_proof.sh OUT_DIR [kernels demo step-triton steps step-xla]}
shift
parts=${*:-kernels demo step-triton steps step-xla}
mkdir -p "$out"
log=$out/run.log
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
small=()
host_flags=(--num_seqs="${HOST_SEQS:-1,8,48}")
standin_flags=(--num_seqs="${STANDIN_SEQS:-1,64,256}")
sampling_flags=()
step_flags=(--batches="${STEP_BATCHES:-1,8}" --spec="${STEP_SPECS:-none,chain:3:1:4,tree:5:4:16}" --nophases
            --noengine --steps=20 --runs=10)
if [ -n "${SMALL:-}" ]; then
  small=(--small)
  host_flags=(--num_seqs="${HOST_SEQS:-2}" --warmup=4 --iterations=6 --min_tokens=3 --max_tokens=6)
  standin_flags=(--num_seqs="${STANDIN_SEQS:-2}" --warmup=4 --iterations=6 --min_tokens=3 --max_tokens=6)
  step_flags=(--batches="${STEP_BATCHES:-1}" --nophases --noengine --steps=3 --runs=2 --spec=none,chain:3:1:4)
  sampling_flags=(--rows=4 --vocab=64 --repeats=1)
fi
# the per-device kernel shapes of mla-tensor / mla-data / moe-kimi; SMALL: tiny ones the interpreter runs
kimi_mla=(--ops=attention --kind=mla --tokens=1,4 --contexts=2048,8192,32768 --device=H200)
kimi_moe=(--ops=moe --moe_format=int4 --moe_tokens=8,40,64,160,256 --device=H200)
tensor_rows=(--heads=8 --batches=64)
data_rows=(--heads=64 --batches=8)
if [ -n "${SMALL:-}" ]; then
  kimi_mla=(--ops=attention --kind=mla --tokens=1,4 --contexts=40 --latent=32 --rope=16 --repeats=1 --device=H200)
  kimi_moe=(--ops=moe --moe_format=int4 --moe_tokens=8,40 --hidden=64 --moe_inter=64 --experts=16 --local_experts=4
            --topk=2 --repeats=1 --device=H200)
  tensor_rows=(--heads=2 --batches=4)
  data_rows=(--heads=8 --batches=2)
fi

part() {  # name, limit in seconds, command...
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "== $name: limit ${limit}s, $(date -u +%H:%M:%S) UTC" | tee -a "$log"
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log" | grep --line-buffered -E '^(\||[a-z].*(ceilings|wrote|error|differ))'
  rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - start)) s$([ "$rc" = 124 ] && echo ' (time limit)')" | tee -a "$log"
}

{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv 2>/dev/null
  python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'; } 2>&1 | tee -a "$log"
for p in $parts; do
  case $p in
    kernels) part kernels "${KERNELS_S:-110}" python3 scripts/gpu_check.py "${small[@]}" --parts=kernels \
               --json_out="$out/kernels.json" --overwrite ;;
    mla-tensor) part mla-tensor "${KERNELS_S:-110}" python3 scripts/bench_kernels.py "${kimi_mla[@]}" \
                  "${tensor_rows[@]}" --layout=tensor --json_out="$out/mla-tensor.json" --overwrite ;;
    mla-data) part mla-data "${KERNELS_S:-110}" python3 scripts/bench_kernels.py "${kimi_mla[@]}" "${data_rows[@]}" \
                --layout=data --json_out="$out/mla-data.json" --overwrite ;;
    moe-kimi) part moe-kimi "${MOE_S:-60}" python3 scripts/bench_kernels.py "${kimi_moe[@]}" \
                --json_out="$out/moe-kimi.json" --overwrite ;;
    attention) part attention "${KERNELS_S:-110}" python3 scripts/bench_kernels.py --ops=attention --batches=1,64 \
                 --tokens=1,4 --contexts=8192 --device=H200 --json_out="$out/attention.json" --overwrite ;;
    gqa) part gqa "${KERNELS_S:-110}" python3 scripts/bench_kernels.py --ops=attention --kind=gqa --batches=1,64 \
           --tokens=1,4 --contexts=8192 --device=H200 --json_out="$out/gqa.json" --overwrite ;;
    sweep) part sweep "${KERNELS_S:-110}" python3 scripts/bench_kernels.py --ops=attention --batches=1,64 \
             --tokens=1,4 --contexts=8192 --page_size="${SWEEP_PAGE:-64}" --device=H200 \
             --attention_launches="${SWEEP_LAUNCHES:-32:8:2:32,32:8:2:64,16:4:2:64,32:8:3:32}" \
             --json_out="$out/sweep.json" --overwrite ;;
    moe-mini) part moe-mini "${MOE_S:-60}" python3 scripts/bench_kernels.py --ops=moe --hidden=128 --moe_inter=96 \
                --experts=8 --local_experts=8 --topk=2 --moe_format=bfloat16 --moe_tokens=1,8,32,192 --device=H200 \
                --json_out="$out/moe-mini.json" --overwrite ;;
    moe-mid) part moe-mid "${MOE_S:-60}" python3 scripts/bench_kernels.py --ops=moe --hidden=2048 --moe_inter=768 \
               --experts=128 --local_experts=128 --topk=8 --moe_format=bfloat16 --moe_tokens=1,8,64,256 --device=H200 \
               --json_out="$out/moe-mid.json" --overwrite ;;
    demo) part demo "${DEMO_S:-130}" python3 scripts/gpu_check.py "${small[@]}" --parts=demo ${DEMO_FLAGS:-} \
            --json_out="$out/demo.json" --overwrite ;;
    steps) part steps "${STEPS_S:-90}" python3 scripts/gpu_check.py "${small[@]}" --parts=steps \
             ${STEP_SHAPES:+--step_shapes=$STEP_SHAPES} \
             --json_out="$out/steps.json" --overwrite ;;
    step-triton|step-xla|step-auto) part "$p" "${STEP_S:-80}" python3 scripts/bench_step.py --kernels="${p#step-}" \
                            "${step_flags[@]}" --json_out="$out/$p.json" --overwrite ;;
    host) part host "${HOST_S:-150}" python3 scripts/bench_host.py --spec=none,chain:3:1:4 "${host_flags[@]}" --phases \
            --json_out="$out/host.json" ;;
    host-standin) part host-standin "${HOST_S:-150}" python3 scripts/bench_host.py --stand_in_device \
                    --spec=none,chain:3:1:4 "${standin_flags[@]}" --phases --json_out="$out/host-standin.json" ;;
    sampling) part sampling "${SAMPLING_S:-90}" python3 benchmarks/harness/sampling-sort-ab.py "${sampling_flags[@]}" \
                --json_out="$out/sampling.json" --overwrite ;;
    *) echo "gpu_proof.sh: unknown part $p (kernels mla-tensor mla-data moe-kimi attention gqa sweep moe-mini moe-mid" \
            "host host-standin sampling" \
            "demo step-triton step-auto steps step-xla)" | tee -a "$log" ;;
  esac
done
