#!/usr/bin/env bash
# Does BEST-RQ pre-training help? Fine-tune its encoder and train the same model from scratch on the
# same labelled subset for the same number of steps, then print both test CERs (unseen voices).
#
#   bash recipes/asr/compare_pretraining.sh                     # 10% of the labels, 1000 steps
#   FRACTION=0.2 STEPS=1500 bash recipes/asr/compare_pretraining.sh
#
# Uses the BEST-RQ run in $BEST_RQ (default outputs/best_rq; trained first with its default config
# and $BRQ_ARGS if absent, ~6 min on 2 CPU cores). The fine-tuned run adds $FT_ARGS (default none,
# as ssl_protocol.sh). Both ASR runs use $ASR_CONFIG (default config_strong_reg.yaml, as
# ssl_protocol.sh: the settings the README's figures were measured with). Each ASR run is ~3 min on 2
# CPU cores. Extra arguments go to both ASR runs (e.g. --report_to none).
set -euo pipefail
cd "$(dirname "$0")/../.."
ACCELERATE=${ACCELERATE:-accelerate}
BEST_RQ=${BEST_RQ:-outputs/best_rq}
FRACTION=${FRACTION:-0.1}        # labelled subset (deterministic: the same utterances in both runs)
STEPS=${STEPS:-1000}             # optimizer steps, both runs
OUT=${OUT:-outputs/compare_pretraining}
BRQ_ARGS=${BRQ_ARGS-""}
FT_ARGS=${FT_ARGS-""}
ASR_CONFIG=${ASR_CONFIG:-recipes/asr/config_strong_reg.yaml}

if [ ! -f "$BEST_RQ/final/model.safetensors" ]; then
    # shellcheck disable=SC2086  # a list of flags
    "$ACCELERATE" launch recipes/best_rq/train.py --output_dir "$BEST_RQ" $BRQ_ARGS
fi
common=(--config "$ASR_CONFIG" --train_fraction "$FRACTION" --max_steps "$STEPS" --eval_steps 250 --save_steps 500 "$@")
# From scratch: feature statistics from the labelled subset.
"$ACCELERATE" launch recipes/asr/train.py "${common[@]}" --output_dir "$OUT/scratch"
# Fine-tuned: BEST-RQ's encoder and feature statistics, every weight trained from step 1 unless
# FT_ARGS says otherwise (--freeze_encoder_steps, --encoder_lr_scale, --layer_decay).
# shellcheck disable=SC2086  # a list of flags
"$ACCELERATE" launch recipes/asr/train.py "${common[@]}" --output_dir "$OUT/best_rq" \
    --init_from "$BEST_RQ" $FT_ARGS

for run in scratch best_rq; do
    "$ACCELERATE" launch recipes/asr/decode.py --checkpoint "$OUT/$run" --split test
done
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
cer = {run: json.loads((out / run / "decode" / "final" / "test-greedy.json").read_text()) for run in ("scratch", "best_rq")}
for run, s in cer.items():
    print(f"{run:>8}: test CER {100 * s['cer']:.2f}%  WER {100 * s['wer']:.2f}%  ({s['utterances']} utterances)")
rel = 1 - cer["best_rq"]["cer"] / cer["scratch"]["cer"]
print(f"relative CER reduction from BEST-RQ pre-training: {100 * rel:.1f}%")
PY
