#!/usr/bin/env bash
# The SSL evaluation protocol (wav2vec 2.0 / HuBERT / BEST-RQ papers, LibriLight's labelled
# subsets): pre-train BEST-RQ once on ~10 h of unlabelled audio (--builtin_corpus ssl10h), then
# train the same ASR model from scratch and from the BEST-RQ encoder on 10 min and on 1 h of labels
# (subsets/10min.txt, subsets/1h.txt), same steps and seed; score the test split (8 voices never
# heard, none of its sentences in any training split) greedily and, when decode.py has --lm, with a
# word n-gram LM; print a markdown table with the wall time of every stage, and write it as a page,
# $OUT/report.html (tools/report.py), each row linking its run's decode report.
#
#   JOBS=2 bash recipes/asr/ssl_protocol.sh --num_threads 1 --report_to none   # the full protocol on 2 cores (2 h 16 min here: README)
#   python -m tools.corpus --profile ssltiny --subset 10 > /tmp/10s.txt         # a smoke run, ~20 min:
#   CORPUS=ssltiny SUBSETS=/tmp/10s.txt PRETRAIN_STEPS=20 FINETUNE_STEPS=20 PROBE_STEPS=10 OUT=/tmp/ssl_smoke \
#       bash recipes/asr/ssl_protocol.sh --report_to none --save_steps 10
#
# Settings (environment): OUT (outputs/ssl_protocol), CORPUS (ssl10h), PRETRAIN_STEPS (12000),
# FINETUNE_STEPS (2000), SUBSETS ("10min 1h", or files of utterance ids), FT_ARGS (what the BEST-RQ-initialized runs add),
# PROBE_STEPS (pre-training checkpoints also fine-tuned on the first subset: the gain as a function
# of pre-training steps; "" for none), ASR_CONFIG (every ASR run's config: config_strong_reg.yaml, the
# settings the protocol's figures were measured with, pinned so that a change of the recipe's
# defaults does not change the protocol),
# ACCELERATE (accelerate), JOBS (1: how many fine-tunings, then test decodes, run at once after the
# pre-training, each logging to $OUT/logs/; 2 on a 2-core machine with --num_threads 1; the figures
# do not depend on it, only the wall times do). Extra arguments go to every training run. A stage whose output is
# complete is not run again (re-running the script resumes) and keeps the wall time recorded when it
# ran ("done before" if none was); a stage cut and resumed counts its last leg only.
set -euo pipefail
cd "$(dirname "$0")/../.."
ACCELERATE=${ACCELERATE:-accelerate}
PYTHON=${PYTHON:-python}
OUT=${OUT:-outputs/ssl_protocol}
CORPUS=${CORPUS:-ssl10h}
PRETRAIN_STEPS=${PRETRAIN_STEPS:-12000}   # BEST-RQ optimizer steps of 60 s batches (~64 min, 1 thread)
FINETUNE_STEPS=${FINETUNE_STEPS:-2000}    # ASR optimizer steps, every run
SUBSETS=${SUBSETS:-"10min 1h"}
PROBE_STEPS=${PROBE_STEPS-"1000 3000 6000 8000"}  # must be multiples of the pre-training's --save_steps (1000)
# Fine-tuning the pre-trained encoder: none of the options by default, every weight at the recipe's
# learning rate from step 1 (recipes/asr/README.md: what freezing and a lower encoder LR did).
FT_ARGS=${FT_ARGS-""}
ASR_CONFIG=${ASR_CONFIG:-recipes/asr/config_strong_reg.yaml}
mkdir -p "$OUT"
TIMES="$OUT/times.tsv"  # stage<TAB>seconds, appended; the report reads each stage's last line
touch "$TIMES"

stage() {  # stage NAME DONE_FILE COMMAND...: run COMMAND unless DONE_FILE exists; record its wall time
    local name=$1 done_file=$2 start
    shift 2
    if [ -e "$done_file" ]; then
        awk -F '\t' -v n="$name" '$1 == n {found = 1} END {exit !found}' "$TIMES" || printf '%s\tdone before\n' "$name" >> "$TIMES"
        return
    fi
    start=$(date +%s)
    "$@" &  # in the background, so that an interrupt reaches the trap below at once, not at the stage's end
    wait $!
    printf '%s\t%s\n' "$name" "$(( $(date +%s) - start ))" >> "$TIMES"
}

JOBS=${JOBS:-1}
spawned=()  # DONE_FILE|NAME|LOG of each stage spawned since the last join
kill_tree() { local child; for child in $(pgrep -P "$1"); do kill_tree "$child"; done; kill "$1" 2>/dev/null || true; }
trap 'for pid in $(jobs -pr); do kill_tree "$pid"; done' EXIT  # a failure or an interrupt stops the stages in flight
trap 'exit 130' INT TERM
spawn() {  # spawn NAME DONE_FILE COMMAND...: `stage` in the background, at most JOBS at once
    local log
    if [ "$JOBS" -le 1 ]; then stage "$@"; return; fi
    while [ "$(jobs -pr | wc -l)" -ge "$JOBS" ]; do wait -n || true; done  # failures: join checks the outputs
    mkdir -p "$OUT/logs"
    log="$OUT/logs/$(tr -c 'A-Za-z0-9_.-' _ <<< "$1" | sed 's/_*$//').log"
    [ -e "$2" ] || echo "started: $1 (log: $log)"
    spawned+=("$2|$1|$log")
    stage "$@" > "$log" 2>&1 &
}
join() {  # wait for every spawned stage; stop if one did not write its output
    local entry failed=0
    wait
    for entry in "${spawned[@]}"; do
        IFS='|' read -r done_file name log <<< "$entry"
        [ -e "$done_file" ] || { echo "ssl_protocol.sh: stage failed: $name (its log: $log)" >&2; failed=1; }
    done
    spawned=()
    [ "$failed" = 0 ] || exit 1
}

stage "corpus $CORPUS (generated once per machine)" /nonexistent \
    "$PYTHON" -m tools.corpus --profile "$CORPUS"
stage "BEST-RQ pre-training, $PRETRAIN_STEPS steps" "$OUT/best_rq/final/COMPLETE" \
    "$ACCELERATE" launch recipes/best_rq/train.py --builtin_corpus "$CORPUS" --output_dir "$OUT/best_rq" \
    --max_steps "$PRETRAIN_STEPS" --save_steps 1000 --save_total_limit 0 "$@"  # every checkpoint kept: PROBE_STEPS

# The named labelled subsets are committed files; one missing (1h.txt until someone generated the
# whole corpus once) is written from the corpus now, by the same rule: commit it.
for subset_arg in $SUBSETS; do
    file="recipes/asr/subsets/$subset_arg.txt"
    case "$subset_arg" in
        10min) seconds=600 ;;
        1h) seconds=3600 ;;
        *) continue ;;
    esac
    if [ ! -f "$file" ]; then
        mkdir -p recipes/asr/subsets
        "$PYTHON" -m tools.corpus --profile "$CORPUS" --subset "$seconds" > "$file.tmp" && mv "$file.tmp" "$file"
        echo "wrote $file: commit it" >&2
    fi
done

runs=()
for subset_arg in $SUBSETS; do
    subset=$(basename "$subset_arg" .txt)  # 10min, 1h, or a subset file's name
    common=(--config "$ASR_CONFIG" --builtin_corpus "$CORPUS" --train_subset "$subset_arg" --max_steps "$FINETUNE_STEPS" --save_steps 500 "$@")
    spawn "ASR $subset, scratch" "$OUT/scratch_$subset/final/COMPLETE" \
        "$ACCELERATE" launch recipes/asr/train.py "${common[@]}" --output_dir "$OUT/scratch_$subset"
    # shellcheck disable=SC2086  # FT_ARGS is a list of flags
    spawn "ASR $subset, BEST-RQ init" "$OUT/best_rq_$subset/final/COMPLETE" \
        "$ACCELERATE" launch recipes/asr/train.py "${common[@]}" --output_dir "$OUT/best_rq_$subset" \
        --init_from "$OUT/best_rq" $FT_ARGS
    runs+=("scratch_$subset" "best_rq_$subset")
    if [ "$subset_arg" = "${SUBSETS%% *}" ]; then  # the first subset: also from earlier pre-training checkpoints
        for step in $PROBE_STEPS; do
            [ "$step" -lt "$PRETRAIN_STEPS" ] || continue
            # shellcheck disable=SC2086
            spawn "ASR $subset, BEST-RQ step $step init" "$OUT/best_rq-step${step}_$subset/final/COMPLETE" \
                "$ACCELERATE" launch recipes/asr/train.py "${common[@]}" --output_dir "$OUT/best_rq-step${step}_$subset" \
                --init_from "$(printf '%s/best_rq/checkpoints/step_%08d' "$OUT" "$step")" $FT_ARGS
            runs+=("best_rq-step${step}_$subset")
        done
    fi
done

join

# A word n-gram LM (lm.py: from a run's training transcripts: data_dir and train_split, i.e. every
# $CORPUS training sentence, none of the test's), when this checkout's decode.py has --lm.
with_lm=""
if "$PYTHON" recipes/asr/decode.py --help 2>/dev/null | grep -q -- "--lm "; then
    with_lm=1
    stage "word 3-gram LM" "$OUT/lm" "$PYTHON" recipes/asr/lm.py --checkpoint "$OUT/${runs[0]}" --output_dir "$OUT/lm"
fi
for run in "${runs[@]}"; do
    spawn "decode $run, greedy" "$OUT/$run/decode/final/test-greedy.json" \
        "$ACCELERATE" launch recipes/asr/decode.py --checkpoint "$OUT/$run" --split test
    if [ -n "$with_lm" ]; then
        spawn "decode $run, LM (alpha, beta tuned on validation)" "$OUT/$run/decode_lm/test-lm.json" \
            "$ACCELERATE" launch recipes/asr/decode.py --checkpoint "$OUT/$run" --split test --lm "$OUT/lm" \
            --tune_lm --output "$OUT/$run/decode_lm"
    fi
done
join

SSL_COMMAND="bash recipes/asr/ssl_protocol.sh $*" "$PYTHON" - "$OUT" "$CORPUS" "$PRETRAIN_STEPS" "$FINETUNE_STEPS" "${runs[@]}" <<'PY'
import json, os, sys
from pathlib import Path
import yaml
out, corpus, pretrain_steps, finetune_steps, runs = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
brq = yaml.safe_load((out / "best_rq" / "final" / "config.yaml").read_text())
print(f"\nBEST-RQ: {pretrain_steps} steps of ≤ {brq['max_batch_seconds']:g} s batches per process "
      f"(≤ {int(pretrain_steps) * brq['max_batch_seconds'] / 3600:.1f} audio-hours seen per process), corpus {corpus}; "
      f"ASR: {finetune_steps} steps each, seed {brq['seed']}\n")
def score(path):
    return json.loads(path.read_text()) if path.exists() else None
print("| labels | init | test CER % greedy | test WER % greedy | test CER % LM | test WER % LM |")
print("|---|---|---|---|---|---|")
cers, lm_cers, page = {}, {}, []  # page: the table's rows for $OUT/report.html
for run in runs:
    init, subset = run.rsplit("_", 1)
    greedy, lm = score(out / run / "decode" / "final" / "test-greedy.json"), score(out / run / "decode_lm" / "test-lm.json")
    cers[run] = greedy["cer"]
    lm_cers[run] = lm["cer"] if lm else None
    lm_cells = f"{100 * lm['cer']:.1f} | {100 * lm['wer']:.1f}" if lm else "– | –"
    name = {"scratch": "scratch", "best_rq": f"BEST-RQ, {pretrain_steps} steps"}.get(init) or f"BEST-RQ, {init.split('step')[1]} steps"
    print(f"| {subset} | {name} | {100 * greedy['cer']:.1f} | "
          f"{100 * greedy['wer']:.1f} | {lm_cells} |")
    decoded = out / run / "decode" / "final" / "test-greedy.html"  # decode.py's page of this run's utterances
    page.append({"id": run, "labels": subset, "init": name, "cer": greedy["cer"], "wer": greedy["wer"],
                 "lm_cer": lm and lm["cer"], "lm_wer": lm and lm["wer"],
                 "utterances": decoded.relative_to(out).as_posix() if decoded.is_file() else None})
for run in runs:
    if run.startswith("best_rq"):
        init, subset = run.rsplit("_", 1)
        steps = pretrain_steps if init == "best_rq" else init.split("step")[1]
        with_lm = lm_cers[run] is not None and lm_cers["scratch_" + subset] is not None
        print(f"\n{subset}, {steps} pre-training steps: relative test-CER reduction from pre-training (greedy): "
              f"{100 * (1 - cers[run] / cers['scratch_' + subset]):.1f} %"
              + (f"; with the LM: {100 * (1 - lm_cers[run] / lm_cers['scratch_' + subset]):.1f} %" if with_lm else ""), end="")
print("\n\n| stage | wall time |\n|---|---|")
times = {}  # stage -> its last recorded time, in the order the stages first ran
for line in (out / "times.tsv").read_text().splitlines():
    name, seconds = line.split("\t")
    times[name] = seconds
for name, seconds in times.items():
    print(f"| {name} | {seconds if not seconds.isdigit() else f'{int(seconds) // 60} min {int(seconds) % 60} s'} |")
from tools.report import write_report  # the same table as a page, each row linking its decode report
write_report(out / "report.html", "SSL protocol: test CER and WER", {
    "corpus": corpus, "BEST-RQ pre-training steps": int(pretrain_steps), "ASR steps": int(finetune_steps),
    "seed": brq["seed"], **{f"wall time: {name}": seconds for name, seconds in times.items()}},
    [("labels", "labels", "text"), ("init", "init", "text"), ("cer", "test CER greedy", "pct"),
     ("wer", "test WER greedy", "pct"), ("lm_cer", "test CER LM", "pct"), ("lm_wer", "test WER LM", "pct"),
     ("utterances", "per utterance", "link")], page, os.environ.get("SSL_COMMAND"))
print(f"\n{out / 'report.html'}: this table as a page")
PY
