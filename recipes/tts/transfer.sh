#!/usr/bin/env bash
# A new voice from 20-60 minutes of its recordings, the way that works on a small voice: transfer.
# Trained from scratch, 0.3 h of one voice is too little for the decoder (it memorizes: validation
# mel flat from step 1000, the synthesized speech hard to understand); started from the built-in
# espeak-ng voice, the same 0.3 h gives speech an ASR model reads almost as well as the recordings
# (README, "Transfer: start from the built-in voice"). Both stages speak espeak-ng phonemes. train.py's
# defaults do the same in one run (`--data_dir DIR --phonemizer_language L`; init_from: auto trains the
# base into the corpus cache for a voice under 10 h): this script is for a base in a folder of your choosing (BASE, BASE_ARGS).
#
#   bash recipes/tts/transfer.sh DATA_DIR LANGUAGE [train.py arguments for the voice ...]
#   bash recipes/tts/transfer.sh data/prompts_fr/ljspeech fr --num_valid 53 --num_test 53
#
# 1. the built-in voice (en-us phonemes, config.yaml's 1000 steps, ~5 min on 2 cores), once per BASE:
#    a second voice starts from the same model;
# 2. the voice (DATA_DIR in the LJSpeech layout, LANGUAGE an espeak-ng voice: fr, es, it, ru, de ...)
#    from it, MAX_STEPS steps (2000: 20-27 min here, 1 thread, on a machine shared with other work), into OUT.
# Then: python recipes/tts/synthesize.py --checkpoint OUT --text "..." --output out.wav
#       python recipes/tts/score.py --checkpoint OUT --split test [--asr_checkpoint <an ASR run of the voice>]
#
# Settings (environment): OUT (outputs/tts_<DATA_DIR's folder name>, or its parent's when that is
# `ljspeech`), BASE (outputs/tts_builtin_phonemes), MAX_STEPS (2000), ACCELERATE (accelerate),
# BASE_ARGS (more train.py arguments for stage 1, e.g. another model size: stage 2 must be given the same).
# A stage whose output is complete is not run again; re-running the script resumes the one that was
# interrupted (the recipe's exact resume). Extra arguments go to the voice's run only.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: bash recipes/tts/transfer.sh DATA_DIR LANGUAGE [train.py arguments for the voice ...]" >&2
    exit 2
fi
DATA_DIR=$1
LANGUAGE=$2
shift 2
if [ ! -d "$DATA_DIR" ]; then
    echo "transfer.sh: DATA_DIR $DATA_DIR is not a folder: give the voice's LJSpeech-layout folder (wavs/ + metadata.csv)" >&2
    exit 2
fi
DATA_DIR=$(cd "$DATA_DIR" && pwd)  # the recipe runs from the repository root
cd "$(dirname "$0")/../.."
ACCELERATE=${ACCELERATE:-accelerate}
BASE=${BASE:-outputs/tts_builtin_phonemes}
MAX_STEPS=${MAX_STEPS:-2000}
name=$(basename "$DATA_DIR")
[ "$name" = ljspeech ] && name=$(basename "$(dirname "$DATA_DIR")")
OUT=${OUT:-outputs/tts_$name}

if [ ! -e "$BASE/final/COMPLETE" ]; then
    echo "transfer.sh: 1/2 the built-in voice in en-us phonemes -> $BASE"
    "$ACCELERATE" launch recipes/tts/train.py --symbols auto --text_frontend phonemes --phonemizer_language en-us \
        --max_seconds 30 --init_from none --output_dir "$BASE" ${BASE_ARGS:-}
fi
echo "transfer.sh: 2/2 $DATA_DIR in $LANGUAGE phonemes, from $BASE -> $OUT"
# --max_seconds 30 keeps every prompt (the default 15 s would leave long ones out, and shift the split);
# --unknown_chars drop: a validation/test phoneme absent from training is left out of that text.
"$ACCELERATE" launch recipes/tts/train.py --data_dir "$DATA_DIR" --max_seconds 30 --symbols auto \
    --unknown_chars drop --text_frontend phonemes --phonemizer_language "$LANGUAGE" --init_from "$BASE" \
    --output_dir "$OUT" --max_steps "$MAX_STEPS" "$@"
echo "transfer.sh: done: $OUT (synthesize.py / score.py --checkpoint $OUT)"
