#!/usr/bin/env bash
# A new voice from 20-60 minutes of its transcribed recordings, the way that works on a small voice:
# start from a model that has heard much more speech. Held-out test CER after 30 minutes of the
# voice's training, from scratch -> from the recipe's default run on the built-in corpus (0.82 h of
# 40 synthetic English voices, with transcripts): French prompts 35.5 -> 24.5 %, Spanish 19.9 -> 13.1 %,
# Italian 22.1 -> 14.8 %, Russian 21.2 -> 16.2 % (README, "A new voice: transfer.sh").
#
# The recipe's default does the same in one command for a voice under 10 h (`config.yaml`'s `init_from: auto`:
# the base is trained once per machine into the corpus cache): `accelerate launch recipes/asr/train.py
# --data_dir DATA_DIR`. This script remains for a base in a folder you name and can decode (BASE, BASE_ARGS).
#
#   bash recipes/asr/transfer.sh DATA_DIR [train.py arguments for the voice ...]
#   bash recipes/asr/transfer.sh data/prompts_fr/librispeech
#
# 1. BASE (default outputs/asr_builtin): the recipe's default run on the built-in corpus (generated on
#    first use, ~30 s), config.yaml's max_steps (4000, ~6.5 min on 2 cores), once per
#    machine: every later voice starts from the same model. BASE may instead be any ASR or BEST-RQ run
#    you already have (its Conformer and feature statistics; the CTC head starts fresh for the new
#    characters): the script then uses it as it is. Measured alternatives (README): a BEST-RQ encoder
#    pre-trained on the built-in ssl10h audio (53 min; French 27.7 %), or the default run started from
#    that encoder (French 23.1 %).
# 2. the voice (DATA_DIR in the LibriSpeech layout: train/, validation/, test/) from it,
#    the recipe's default config, into OUT.
# Then: accelerate launch recipes/asr/decode.py --checkpoint OUT --split test
#
# Settings (environment): OUT (outputs/asr_<DATA_DIR's folder name>, or its parent's when that is
# `librispeech`), BASE (outputs/asr_builtin), ACCELERATE (accelerate), BASE_ARGS (more train.py
# arguments for stage 1, e.g. another corpus or model size: stage 2 must then be given the same model
# fields). A stage whose output is complete is not run again; re-running the script resumes the one
# that was interrupted (the recipe's exact resume). Extra arguments go to the voice's run only.
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
BASE=${BASE:-outputs/asr_builtin}
name=$(basename "$DATA_DIR")
[ "$name" = librispeech ] && name=$(basename "$(dirname "$DATA_DIR")")
OUT=${OUT:-outputs/asr_$name}

if [ ! -e "$BASE/final/COMPLETE" ]; then
    echo "transfer.sh: 1/2 ASR on the built-in corpus (the recipe's default run) -> $BASE"
    # shellcheck disable=SC2086  # BASE_ARGS is a list of flags
    "$ACCELERATE" launch recipes/asr/train.py --output_dir "$BASE" ${BASE_ARGS:-}
fi
echo "transfer.sh: 2/2 $DATA_DIR from $BASE -> $OUT"
"$ACCELERATE" launch recipes/asr/train.py --data_dir "$DATA_DIR" --init_from "$BASE" --output_dir "$OUT" "$@"
echo "transfer.sh: done: $OUT (decode.py --checkpoint $OUT --split test)"
