#!/usr/bin/env bash
# A vocoder for a new voice from 20-60 minutes of its recordings: transfer. 0.3 h of one voice is
# little for a GAN vocoder; started from the built-in espeak-ng voice it beats the same compute from
# scratch on PESQ, STOI and MCD (results/vocoder/RESULTS.md, "Transfer: start from the built-in voice").
#
#   bash recipes/vocoder/transfer.sh DATA_DIR [train.py arguments for the voice ...]
#   bash recipes/vocoder/transfer.sh data/prompts_es/ljspeech --num_valid 48 --num_test 52
#
# The plain command does the same by default (config.yaml's --init_from auto: the base trained once per
# machine into the corpus cache, its last checkpoint), and for a TTS run's voice takes its data and split:
#   accelerate launch recipes/vocoder/train.py --tts_run outputs/tts_es      # into outputs/tts_es/vocoder
# This script is the explicit form: the base in a folder of your choosing (BASE), of BASE_STEPS and BASE_ARGS.
#
# 1. the built-in voice (BASE_STEPS, 1000: ~27 min here, 1 thread beside another run), once per BASE:
#    a second voice starts from the same model;
# 2. the voice (DATA_DIR in the LJSpeech layout) from the base's last checkpoint (the generator and
#    both discriminators), MAX_STEPS steps (1000), into OUT.
# Give the voice the --num_valid/--num_test of its TTS run (recipes/tts/transfer.sh): the vocoder then
# holds out the same prompts, and the TTS scores (score.py --vocoder OUT) stay on unheard ones.
# Then: python recipes/vocoder/evaluate.py --checkpoint OUT
#       python recipes/tts/synthesize.py --checkpoint <the voice's TTS run> --vocoder OUT --text "..."
#
# Settings (environment): OUT (outputs/vocoder_<DATA_DIR's folder name>, or its parent's when that is
# `ljspeech`), BASE (outputs/vocoder_builtin), BASE_STEPS (1000), MAX_STEPS (1000), ACCELERATE
# (accelerate), BASE_ARGS (more train.py arguments for stage 1, e.g. another model size: stage 2 must
# be given the same). A stage whose output is complete is not run again; re-running the script
# resumes the one that was interrupted (the recipe's exact resume). Extra arguments go to the voice's run.
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: bash recipes/vocoder/transfer.sh DATA_DIR [train.py arguments for the voice ...]" >&2
    exit 2
fi
DATA_DIR=$1
shift
if [ ! -d "$DATA_DIR" ]; then
    echo "transfer.sh: DATA_DIR $DATA_DIR is not a folder: give the voice's LJSpeech-layout folder (wavs/ + metadata.csv)" >&2
    exit 2
fi
DATA_DIR=$(cd "$DATA_DIR" && pwd)  # the recipe runs from the repository root
cd "$(dirname "$0")/../.."
ACCELERATE=${ACCELERATE:-accelerate}
BASE=${BASE:-outputs/vocoder_builtin}
BASE_STEPS=${BASE_STEPS:-1000}
MAX_STEPS=${MAX_STEPS:-1000}
name=$(basename "$DATA_DIR")
[ "$name" = ljspeech ] && name=$(basename "$(dirname "$DATA_DIR")")
OUT=${OUT:-outputs/vocoder_$name}

if [ ! -e "$BASE/final/COMPLETE" ]; then
    echo "transfer.sh: 1/2 the built-in voice -> $BASE"
    # shellcheck disable=SC2086  # BASE_ARGS is a list of flags
    "$ACCELERATE" launch recipes/vocoder/train.py --output_dir "$BASE" --max_steps "$BASE_STEPS" ${BASE_ARGS:-}
fi
# The last checkpoint, not final/: an export holds the generator only, a checkpoint the discriminators too.
start=$(find "$BASE/checkpoints" -maxdepth 2 -name COMPLETE -path '*/step_*' 2>/dev/null | sort | tail -n 1)
if [ -z "$start" ]; then
    echo "transfer.sh: $BASE has no complete checkpoints/step_*/ folder: remove $BASE and run again" >&2
    exit 2
fi
start=$(dirname "$start")
echo "transfer.sh: 2/2 $DATA_DIR from $start -> $OUT"
# --max_seconds 30 keeps every prompt (as the TTS transfer does: the same held-out ids);
# --max_batch_seconds 32 leaves room for one such prompt per batch. Each unless the voice's arguments
# set it (train.py refuses a flag given twice).
given() { local flag=$1 arg; shift; for arg in "$@"; do [[ $arg == "$flag" || $arg == "$flag="* ]] && return 0; done; return 1; }
defaults=()
given --max_seconds "$@" || defaults+=(--max_seconds 30)
given --max_batch_seconds "$@" || defaults+=(--max_batch_seconds 32)
"$ACCELERATE" launch recipes/vocoder/train.py --data_dir "$DATA_DIR" ${defaults[@]+"${defaults[@]}"} \
    --init_from "$start" --output_dir "$OUT" --max_steps "$MAX_STEPS" "$@"
echo "transfer.sh: done: $OUT (evaluate.py --checkpoint $OUT; synthesize.py / score.py --vocoder $OUT)"
