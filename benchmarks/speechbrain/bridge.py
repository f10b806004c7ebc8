"""Our LibriSpeech-layout corpus → the CSV files SpeechBrain's LibriSpeech recipes read.

SpeechBrain's `librispeech_prepare.py` writes one CSV per split with the columns
`ID, duration, wav, spk_id, wrd` (duration in seconds, wav an audio path); its BEST-RQ `train.py`
reads `duration` (filtering, dynamic batching) and `wav` (`sb.dataio.dataio.read_audio`). We write
the same columns from our own manifest scan, so both sides train on exactly the same files.

    PYTHONPATH=. python benchmarks/speechbrain/bridge.py --data_dir DIR --split train --out train.csv
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from common.data.manifest import read_librispeech

COLUMNS = ["ID", "duration", "wav", "spk_id", "wrd"]  # as SpeechBrain's librispeech_prepare.py writes them


def write_speechbrain_csv(data_dir: str | Path, split: str, out: str | Path) -> dict[str, float]:
    """Write `out` for `<data_dir>/<split>`; returns {utterance id: duration in seconds}.

    A problem in the corpus (missing, unreadable audio, malformed transcript) raises DataError,
    as it does for our recipes: a CSV with holes would make the two sides train on different data.
    """
    manifest = read_librispeech(data_dir, split)
    if len(manifest) == 0:
        raise ValueError(f"{Path(data_dir) / split} holds no utterances; point --data_dir at a LibriSpeech-layout root")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)  # quotes a transcript holding a comma, as csv.DictReader expects
        writer.writerow(COLUMNS)
        for row in manifest:
            writer.writerow([row["id"], f"{row['duration']:.6f}", str(Path(row["path"]).resolve()),
                             row["speaker"], row["text"]])
    tmp.replace(out)  # a half-written CSV never carries the final name
    return {row["id"]: row["duration"] for row in manifest}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", required=True, help="LibriSpeech-layout root")
    parser.add_argument("--split", required=True, help="subfolder of data_dir (train, validation, ...)")
    parser.add_argument("--out", required=True, help="CSV file to write")
    args = parser.parse_args(argv)
    durations = write_speechbrain_csv(args.data_dir, args.split, args.out)
    print(f"{args.out}: {len(durations)} utterances, {sum(durations.values()) / 3600:.3f} h")


if __name__ == "__main__":
    main()
