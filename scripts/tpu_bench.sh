#!/usr/bin/env bash
# The TPU benchmark rows of issue 41 (python -m benchmarks --cases accelerator --device tpu), in
# parts that fit the device's calls: scripts/tpu_bench.sh PART... (default: every part), run
# from the repository root with PYTHONPATH set as scripts/tpu_check.sh sets it. A part that
# would start after $BRIDGE_MR_TPU_BENCH_UNTIL (seconds since the epoch) is skipped, and says so.
#
#   tiny      the tiny call, highest and medium: torch loop (host), bridge_mr auto, pure JAX
#   cnn50     the CNN round, 50 clients, highest: torch loop (host), torch.func.vmap (host),
#             bridge_mr auto, vmap and per_client, pure JAX
#   cnn       the CNN round, 50 and 500 clients, medium, and 500 highest: bridge_mr, pure JAX
#   gpt2      GPT-2 2x128, 16 clients highest: torch loop (host), bridge_mr, pure JAX; 16 and
#             128 clients medium and 128 highest: bridge_mr, pure JAX
#   cache     the on-disk compile cache: the CNN round's first round in a fresh process twice
#             (and a third under cProfile: $OUT/cache_third.prof); then twice more with JAX's
#             runtime started before the round, timed apart ($CACHE_ALT=pure_jax: the same
#             pairs for pure JAX with JAX's persistent compilation cache)
#   convs     issue 42's rows: the CNN round's per-client convolutions grouped or as matrix
#             products, 50 / 500 / 2000 clients, medium and highest, in one process
#             (benchmarks/studies/bench_conv_lowering.py --profile: each variant's device ops too;
#             $CONVS_S seconds, default 330; $CONVS_ROWS: other rows, e.g. "50:medium 500:medium")
#   forms     the CNN round hand-written in JAX, side by side in one process: vmap, one client
#             at a time, or G clients at a time packed into the channels (packG), max-pool by
#             reduce_window or by a reshape, NCHW or NHWC, flattened or contracted whole by the
#             linear layer (:dot), loops unrolled (:uK, :oK), K clients or groups vmapped a
#             step (:vK), 50 and 500 clients (benchmarks/studies/bench_cnn_forms.py; 50 highest
#             against the host CPU too, and where the per-client round's time goes on the chip:
#             --profile; $FORMS_ROWS picks rows, $FORMS_VARIANTS replaces each row's variants,
#             $FORMS_S is each row's limit in seconds, 200 by default)
#   precision per-client convolutions (vmap and one at a time) and one CNN gradient step against
#             the host CPU, at each precision (benchmarks/studies/bench_conv_precision.py)
#   resident  the CNN round, 50 and 500 clients, medium: bridge_mr with host client data,
#             bridge_mr_resident (client data on the chip as JAX arrays), pure JAX
#   call      the tiny call's time and its host-side profile: bridge_mr beside pure JAX with and
#             without host transfers (benchmarks/studies/profile_call.py), highest precision
#   raw:ALTERNATIVE:MODEL:CLIENTS:PRECISION  one worker's first round and 3 rounds ($RAW_ROUNDS),
#             as they come, within $RAW_S seconds (default 120)
#             (ALTERNATIVE *_torchtpu: on TorchTPU's "tpu" tensors, once scripts/torch_tpu_setup.sh
#             is ready)
#   ttprof:MODEL:CLIENTS:PRECISION  the round on TorchTPU tensors timed in parts, its programs
#             saved to /tmp/ttprof_MODEL_CLIENTS (benchmarks/studies/profile_torch_tpu.py)
#   replay:MODEL:CLIENTS  those saved programs run by JAX holding the chip, timed (both parts
#             serialize programs, which needs flatbuffers: carry its wheel in .whl-tpu,
#             `pip download flatbuffers --no-deps -d .whl-tpu`, and scripts/tpu_check.sh installs it)
#
# Each part's table goes to $OUT/bench_PART*.txt and its results.json under $OUT/bench_PART*/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/tpu_logs}
UNTIL=${BRIDGE_MR_TPU_BENCH_UNTIL:-0}
mkdir -p "$OUT"
status=0

bench() {  # bench NAME SECONDS ARGS...: one benchmarks run, its workers ended with it
  local name=$1 limit=$2
  shift 2
  echo "tpu_bench: $name: python -m benchmarks --cases accelerator --device tpu $*"
  timeout -k 10 "$limit" python3 -m benchmarks --cases accelerator --device tpu --no-plots \
    --no-xla --out "$OUT/bench_$name" "$@" 2>&1 | tee "$OUT/bench_$name.txt"
  local code=${PIPESTATUS[0]}
  pkill -f benchmarks.workers.users 2>/dev/null  # a timed-out run's workers hold the chip
  [ "$code" -eq 0 ] || { echo "tpu_bench: $name exited $code"; status=1; }
}

cache() {  # the CNN round's first round in a fresh process, twice, sharing one cache folder
  # ($CACHE_ALT: the alternative, default bridge_mr; pure_jax caches through JAX's own
  # persistent compilation cache, JAX_COMPILATION_CACHE_DIR, as its users would set it)
  local alt=${CACHE_ALT:-bridge_mr} folder
  folder=$(mktemp -d)
  local spec="{\"workload\": \"accelerator\", \"alternative\": \"$alt\", \"save\": \"/tmp/cache.npz\",
    \"config\": {\"model\": \"cnn\", \"clients\": 50, \"steps\": 5, \"batch\": 10, \"device\": \"tpu\"}}"
  local process jaxdir=()  # bridge_mr's own cache stands aside when JAX's is configured
  [ "$alt" = bridge_mr ] || jaxdir=(JAX_COMPILATION_CACHE_DIR="$folder/jax")
  for process in first second; do
    echo quit | env BRIDGE_MR_CACHE_DIR="$folder" "${jaxdir[@]}" timeout -k 10 240 \
      python3 -m benchmarks.workers.users "$spec" 2>&1 | grep -E '"event": "ready"|Error' \
      | sed "s/^/tpu_bench: cache $alt: $process process: /" | tee -a "$OUT/bench_cache.txt"
  done
  # The same pair in a fresh folder with JAX's runtime started before the round (timed apart,
  # "backend_s"): the first round without the runtime's start, which any JAX program pays.
  local started=$(mktemp -d)
  [ "$alt" = bridge_mr ] || jaxdir=(JAX_COMPILATION_CACHE_DIR="$started/jax")
  for process in first second; do
    echo quit | env BRIDGE_MR_CACHE_DIR="$started" "${jaxdir[@]}" \
      timeout -k 10 240 python3 -m benchmarks.workers.users "${spec%\}}, \"start_backend\": true}" \
      2>&1 | grep -E '"event": "ready"|Error' \
      | sed "s/^/tpu_bench: cache $alt, runtime started first: $process process: /" \
      | tee -a "$OUT/bench_cache.txt"
  done
  rm -rf "$started"
  # A third bridge_mr process under cProfile (its time not reported: the profiler slows it), for
  # where a cached first round's time goes: $OUT/cache_third.prof (python -m pstats).
  if [ "$alt" = bridge_mr ]; then
    echo quit | BRIDGE_MR_CACHE_DIR=$folder timeout -k 10 240 python3 -m cProfile \
      -o "$OUT/cache_third.prof" -m benchmarks.workers.users "$spec" >/dev/null 2>&1
  fi
  rm -rf "$folder"
}

raw() {  # raw ALTERNATIVE MODEL CLIENTS PRECISION: one worker's events as they come (a first
  # round, then 3 rounds), for what a call's time limit would cut off before a table is written
  local spec="{\"workload\": \"accelerator\", \"alternative\": \"$1\", \"save\": \"/tmp/raw.npz\",
    \"config\": {\"model\": \"$2\", \"clients\": $3, \"steps\": ${STEPS:-5}, \"batch\": ${BATCH:-10},
    \"device\": \"tpu\", \"precision\": \"$4\"}}"
  local env=()
  if [[ $1 == *_torchtpu* ]]; then  # TorchTPU holds the chip (scripts/torch_tpu_setup.sh)
    env=(JAX_PLATFORMS=cpu "PYTHONPATH=/tmp/tt_site:$PYTHONPATH:/tmp/tt_deps")
  elif [[ $1 == torch* ]]; then
    env=(JAX_PLATFORMS=cpu)
  fi
  local commands
  commands="$(printf 'round\n%.0s' $(seq "${RAW_ROUNDS:-3}"))"$'\n'quit
  echo "$commands" | env "${env[@]}" timeout -k 5 "${RAW_S:-120}" python3 \
    -m benchmarks.workers.users "$spec" 2>&1 | grep -E '"event"|Error' \
    | sed "s/^/tpu_bench: raw $1 $2 c$3 $4: /" | tee -a "$OUT/bench_raw.txt"
}

ttprof() {  # ttprof MODEL CLIENTS PRECISION: on TorchTPU tensors (scripts/torch_tpu_setup.sh)
  JAX_PLATFORMS=cpu PYTHONPATH=/tmp/tt_site:$PYTHONPATH:/tmp/tt_deps timeout -k 5 240 python3 \
    -m benchmarks.studies.profile_torch_tpu --model "$1" --clients "$2" --precision "$3" \
    --save "/tmp/ttprof_$1_$2" 2>&1 | grep -E '"event"|Error' | tee -a "$OUT/profile_torch_tpu.txt"
}

convs() {  # issue 42's rows in one process, cut at $CONVS_S seconds (the rows so far are kept)
  # CONVS_ARGS: more arguments, e.g. "--chunks --grouped 2 --packed 2 4"
  local limit=${CONVS_S:-330}
  echo "tpu_bench: convs: python -m benchmarks.studies.bench_conv_lowering --until $((limit - 30))"
  timeout -k 10 "$limit" python3 -m benchmarks.studies.bench_conv_lowering --device tpu \
    --until $((limit - 30)) --profile ${CONVS_ROWS:+--rows $CONVS_ROWS} ${CONVS_ARGS:-} \
    --out "$OUT/bench_convs.md" 2>&1 | tee "$OUT/bench_convs.txt"
  local code=${PIPESTATUS[0]}
  [ "$code" -eq 0 ] || { echo "tpu_bench: convs exited $code"; status=1; }
}

forms() {  # the hand-written forms of the CNN round, each row's variants in one process
  local row variants  # FORMS_ROWS picks rows ("50:medium 500:highest"); all four take 800 s
  for row in "50:medium:--profile" "50:highest:--cpu-reference" "500:medium:" "500:highest:"; do
    IFS=: read -r clients precision flag <<<"$row"
    [[ " ${FORMS_ROWS:-$clients:$precision} " == *" $clients:$precision "* ]] || continue
    case $clients:$precision in  # at "highest" compiling takes 15-28 s a variant
      50:medium) variants="vmap:rw:nchw map:rs:nchw map:rs:nchw:dot pack2:rs:nchw pack5:rs:nchw
                   pack10:rs:nchw pack5:rs:nhwc:dot" ;;
      50:highest) variants="map:rs:nchw pack2:rs:nchw pack4:rs:nchw" ;;
      500:medium) variants="map:rs:nchw pack2:rs:nchw pack4:rs:nchw pack5:rs:nchw pack10:rs:nchw" ;;
      *) variants="map:rs:nchw pack2:rs:nchw pack4:rs:nchw" ;;
    esac
    variants=${FORMS_VARIANTS:-$variants}  # e.g. "pack2:rs:nchw pack2:rs:nchw:u5:o2"
    # shellcheck disable=SC2086
    timeout -k 10 "${FORMS_S:-200}" python3 -m benchmarks.studies.bench_cnn_forms \
      --rows "$clients:$precision" --variants $variants --reps 5 $flag 2>&1 | grep -v -i warn | tee -a "$OUT/bench_forms.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "tpu_bench: forms $clients:$precision failed"; status=1; }
  done
}

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tiny cnn50 cnn gpt2 cache)
for part in "${parts[@]}"; do
  if [ "$UNTIL" -gt 0 ] && [ "$(date +%s)" -ge "$UNTIL" ]; then
    echo "tpu_bench: $part skipped: past BRIDGE_MR_TPU_BENCH_UNTIL"
    status=1
    continue
  fi
  case $part in
    tiny) bench tiny 150 --models tiny --precision highest medium --reps 3 \
            --alternatives torch_loop bridge_mr pure_jax ;;
    # cnn50: 420 s, a call of its own (at 240 s a 2026-12-06 run, the host's torch loop at
    # 2.2 s a round, was cut off before its table)
    cnn50) bench cnn50 420 --models cnn --clients 50 --reps 3 --alternatives torch_loop \
             torch_vmap bridge_mr bridge_mr:vmap bridge_mr:per_client pure_jax ;;
    cnn) bench cnn_medium 150 --models cnn --clients 50 500 --precision medium --reps 3 \
           --alternatives bridge_mr pure_jax
         bench cnn500 120 --models cnn --clients 500 --reps 3 --alternatives bridge_mr pure_jax ;;
    gpt2) bench gpt2_16 150 --models gpt2_128 --clients 16 --reps 3 \
            --alternatives torch_loop bridge_mr pure_jax
          bench gpt2_medium 180 --models gpt2_128 --clients 16 128 --precision medium --reps 3 \
            --alternatives bridge_mr pure_jax
          bench gpt2_128 120 --models gpt2_128 --clients 128 --reps 3 \
            --alternatives bridge_mr pure_jax ;;
    cache) cache ;;
    resident) bench resident 270 --models cnn --clients 50 500 --precision medium --reps 3 \
                --alternatives bridge_mr bridge_mr_resident pure_jax ;;
    convs) convs ;;
    forms) forms ;;
    precision) timeout -k 10 200 python3 -m benchmarks.studies.bench_conv_precision 2>&1 \
                 | grep -v -i warn | tee "$OUT/bench_precision.txt"
               [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "tpu_bench: precision failed"; status=1; } ;;
    call) timeout -k 10 150 python3 -m benchmarks.studies.profile_call --device tpu 2>&1 \
            | tee "$OUT/profile_call.txt"
          [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "tpu_bench: call failed"; status=1; } ;;
    ttprof:*) IFS=: read -r _ model clients precision <<<"$part"; ttprof "$model" "$clients" "$precision" ;;
    replay:*) IFS=: read -r _ model clients <<<"$part"
              timeout -k 5 150 python3 -m benchmarks.studies.profile_torch_tpu \
                --replay "/tmp/ttprof_${model}_$clients" 2>&1 | grep -E '"event"|Error' \
                | sed "s/^/replay $model c$clients: /" | tee -a "$OUT/profile_torch_tpu.txt" ;;
    raw:*) rest=${part#raw:}  # the alternative may hold colons (bridge_mr:chunks:16)
           precision=${rest##*:}; rest=${rest%:*}; clients=${rest##*:}; rest=${rest%:*}
           model=${rest##*:}; raw "${rest%:*}" "$model" "$clients" "$precision" ;;
    *) echo "tpu_bench: unknown part $part (tiny, cnn50, cnn, gpt2, cache, resident, convs, forms, precision, call, raw:..., ttprof:..., replay:...)"; status=1 ;;
  esac
done
exit $status
