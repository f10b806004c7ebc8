#!/usr/bin/env bash
# A new voice from 20-60 minutes of its transcribed recordings, the way that works on a small voice:
# start the encoder from one that has heard much more speech. Held-out test CER after 30 minutes of
# the voice's training, from scratch -> from BEST-RQ pre-trained on the built-in `ssl10h` audio (10.7 h
# of 216 synthetic English voices, transcripts unused): French prompts 35.5 -> 27.7 %, Spanish
# 19.9 -> 15.3 %, Italian 22.1 -> 17.4 % (README, "A new voice from a BEST-RQ encoder").
#
#   bash recipes/asr/transfer.sh DATA_DIR [train.py arguments for the voice ...]
#   bash recipes/asr/transfer.sh data/prompts_fr/librispeech
#
# 1. BASE (default outputs/best_rq_ssl10h): BEST-RQ on `--builtin_corpus ssl10h` (the corpus is
#    generated on first use, ~8 min on 2 cores), PRETRAIN_STEPS optimizer steps (8000: 53 min here,
#    1 thread, beside another training), once per machine: every later voice starts from the same
#    encoder. BASE may instead be an ASR run you already have (its Conformer and feature statistics;
#    the CTC head starts fresh for the new characters): the script then uses it as it is.
# 2. the voice (DATA_DIR in the LibriSpeech layout: train/, validation/, test/) from it,
#    the recipe's default config, into OUT.
# Then: accelerate launch recipes/asr/decode.py --checkpoint OUT --split test
#
# Settings (environment): OUT (outputs/asr_<DATA_DIR's folder name>, or its parent's when that is
# `librispeech`), BASE (outputs/best_rq_ssl10h), PRETRAIN_STEPS (8000), ACCELERATE (accelerate),
# BASE_ARGS (more best_rq/train.py arguments for stage 1, e.g. another corpus or model size: stage 2
# must then be given the same model fields). A stage whose output is complete is not run again;
# re-running the script resumes the one that was interrupted (the recipes' exact resume). Extra
# arguments go to the voice's run only.
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: bash recipes/asr/transfer.sh DATA_DIR [train.py arguments for the voice ...]" >&2
    exit 2
fi
DATA_DIR=$1
shift
if [ ! -d "$DATA_DIR" ]; then
    echo "transfer.sh: DATA_DIR $DATA_DIR is not a folder: give the voice's LibriSpeech-layout folder (train/, validation/, test/)" >&2
    exit 2
fi
DATA_DIR=$(cd "$DATA_DIR" && pwd)  # the recipes run from the repository root
cd "$(dirname "$0")/../.."
ACCELERATE=${ACCELERATE:-accelerate}
BASE=${BASE:-outputs/best_rq_ssl10h}
PRETRAIN_STEPS=${PRETRAIN_STEPS:-8000}
name=$(basename "$DATA_DIR")
[ "$name" = librispeech ] && name=$(basename "$(dirname "$DATA_DIR")")
OUT=${OUT:-outputs/asr_$name}

if [ ! -e "$BASE/final/COMPLETE" ]; then
    echo "transfer.sh: 1/2 BEST-RQ on the built-in ssl10h audio, $PRETRAIN_STEPS steps -> $BASE"
    # shellcheck disable=SC2086  # BASE_ARGS is a list of flags
    "$ACCELERATE" launch recipes/best_rq/train.py --builtin_corpus ssl10h --output_dir "$BASE" \
        --max_steps "$PRETRAIN_STEPS" --save_steps 1000 ${BASE_ARGS:-}
fi
echo "transfer.sh: 2/2 $DATA_DIR from $BASE -> $OUT"
"$ACCELERATE" launch recipes/asr/train.py --data_dir "$DATA_DIR" --init_from "$BASE" --output_dir "$OUT" "$@"
echo "transfer.sh: done: $OUT (decode.py --checkpoint $OUT --split test)"
