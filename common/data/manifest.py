"""Manifests from LibriSpeech / LJSpeech layouts or `datasets` audiofolders, validated once before training starts.

An audiofolder (`AUDIOFOLDER_LAYOUT`, `scan_audiofolder`) stands where the other layouts would: at
<data_dir>/<split>/ for a recipe that reads splits (where LibriSpeech's split folders are), at
<data_dir> for one that reads a folder (where LJSpeech's metadata.csv is); a metadata.csv whose first
line holds a '|' is LJSpeech's. Its rows go through the same data check.

`prepare_manifest` scans a corpus, reads every audio file once, and sorts entries into usable
rows and problems: missing files, unreadable or corrupt audio, empty audio, too short or too long,
empty transcripts, characters outside the symbol table, wrong sample rate (resampled on load, or
refused), multi-channel audio, duplicate utterance ids, malformed transcript/metadata lines.
Policy `on_bad_data="error"` stops with a report naming every offending entry; `"skip"` drops them
and logs the counts. Nothing crashes hours into training because of one file.

How much of each file is read is `DataPolicy.data_check` (the list of what each mode finds is in
`common.data.datacheck`):
- `"header"` (default): header + the end of the file decoded. Finds missing, unreadable, truncated,
  zero-length, multi-channel, wrong-rate, too short / too long audio.
- `"full"`: every sample, ~25× slower on LibriSpeech-length files. Also finds silent audio (all zeros), non-finite samples, and
  corruption in the middle of a file whose end still decodes. Header mode accepts those.

The files are read by a process pool (all the cores this process may use) and the per-file facts
are cached in `<output_dir>/data/<name>.check-<mode>-v<version>.jsonl`: a check killed half-way
resumes, and a corpus with a few new or changed files re-reads only those.

The pass runs once per output folder: the first process to arrive builds
`<output_dir>/data/<name>-<fingerprint>/` (manifest.jsonl + problems.jsonl) under a file lock
(`common.training.prepare.prepare_once`) while the others wait, and a re-launch reuses it. The fingerprint
covers the file listing (names, sizes, mtimes, ctimes) and the policy, so a fixed corpus is re-checked.
"""
from __future__ import annotations

import csv
import glob
import hashlib
import json
import logging
import os
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import datasets
import soundfile as sf

from common.data.datacheck import CACHE_VERSION, MODES, Stamp, audio_facts, check_files, list_files
from common.training.faults import RunError, UsageError
from common.training.prepare import prepare_once

logger = logging.getLogger(__name__)
REPORT_GRACE_S = 60.0  # a non-main rank waits this long for the main process to print the data report

LIBRISPEECH_ID = re.compile(r"^(\d+)-(\d+)-(\d+)$")
# The folder layouts --data_dir may hold, as the refusals name them.
LIBRISPEECH_LAYOUT = ("LibriSpeech layout: <data_dir>/<split>/<speaker>/<chapter>/<speaker>-<chapter>-<n>.flac "
                      "and <speaker>-<chapter>.trans.txt lines '<speaker>-<chapter>-<n> TEXT'")
LJSPEECH_LAYOUT = "LJSpeech layout: <data_dir>/metadata.csv lines 'id|text|normalized text' and <data_dir>/wavs/<id>.wav"
# `datasets`' audiofolder convention (its packaged_modules/folder_based_builder): a metadata file beside the
# audio, `file_name` relative to the metadata file's folder; one such folder per split.
AUDIOFOLDER_LAYOUT = ("audiofolder layout: <folder>/metadata.csv with a header line naming file_name (the audio's path "
                      "inside <folder>), text or transcription, optionally speaker or speaker_id (or metadata.jsonl, "
                      "one JSON object with those keys per line)")
METADATA_FILES = ("metadata.csv", "metadata.jsonl")


class DataError(RunError):
    """The corpus has entries the policy does not accept; the message lists every one (printed by
    `run_main` without a traceback: the report is the whole story). Exit code 2, as a usage error:
    the fix is the user's (the data or the command), and re-running as it is fails again."""

    exit_code = 2


def _layout_error(root: Path, missing: Path, layout: str) -> DataError:
    """One line: what is missing, the layouts expected, what the folder holds instead."""
    try:
        found = sorted(p.name + ("/" if p.is_dir() else "") for p in Path(root).iterdir())
    except OSError:
        found = []
    holds = f"it holds {', '.join(found[:6])}{', ...' if len(found) > 6 else ''}" if found else "it is empty"
    if layout == LJSPEECH_LAYOUT and next(glob.iglob(os.path.join(glob.escape(str(root)), "*", "*", "*", "*.trans.txt")), None):
        holds += ": the LibriSpeech layout, which this recipe does not read from --data_dir"
    nested = next((m.parent for name in METADATA_FILES for m in sorted(Path(root).glob(f"*/{name}"))), None)
    if layout == LJSPEECH_LAYOUT and nested is not None:
        holds += f": {nested.name}/ is an audiofolder; this recipe reads one folder: give --data_dir {nested}"
    if layout != LJSPEECH_LAYOUT and audiofolder_metadata(Path(root)) is not None:
        holds += (": one audiofolder for the whole corpus, and this recipe reads splits: give each its own folder, "
                  "<data_dir>/<split>/metadata.csv")
    per_split = " in each <data_dir>/<split>/" if layout != LJSPEECH_LAYOUT else " in <data_dir>"
    return DataError(f"--data_dir {root}: {missing.name} not found ({holds}); expected the {layout}, or the "
                     f"{AUDIOFOLDER_LAYOUT}{per_split}. "
                     f"A `datasets` source (a folder of data files such as <folder>/data/train-*.parquet, or a Hub "
                     f"dataset name) is read with --dataset_name <it> instead of --data_dir; convert any other layout to one of these")


@dataclass(frozen=True)
class DataPolicy:
    sample_rate: int  # Hz expected by the recipe
    min_seconds: float = 0.5  # shorter audio is refused (the model needs a few frames)
    max_seconds: float = 30.0  # longer audio is refused (one utterance must fit a batch)
    wrong_sample_rate: str = "resample"  # "resample" (on load) | "refuse"
    charset: str | None = None  # allowed transcript characters; None = transcripts are not used
    on_bad_data: str = "error"  # "error": stop with a report | "skip": drop the entries, log counts
    data_check: str = "header"  # "header": headers + last block of each file | "full": decode every sample

    def __post_init__(self):
        if self.data_check not in MODES:
            raise ValueError(f"data_check must be one of {', '.join(MODES)}, not {self.data_check!r}")


# ---------------------------------------------------------------------------------------------
# Scanning: rows (id, path, text, speaker) and problems (entry, reason) from the folder layout
# ---------------------------------------------------------------------------------------------


def _lines(path: str | Path, encoding: str = "utf-8"):
    """(line number, text or None if it is not valid `encoding`, raw bytes) for each line."""
    with open(path, "rb") as f:
        data = f.read()
    for n, raw in enumerate(data.splitlines(), 1):
        try:
            yield n, raw.decode(encoding), raw
        except UnicodeDecodeError:
            yield n, None, raw
        encoding = "utf-8" if encoding == "utf-8-sig" else encoding  # a byte-order mark only starts a file


def scan_librispeech(root: str | Path, splits: str) -> tuple[list[dict], list[dict]]:
    """`<root>/<split>/<spk>/<chap>/<spk>-<chap>.trans.txt` lines `<spk>-<chap>-<utt> TEXT`;
    `splits` may join several subfolders with commas (`train-clean-100,train-clean-360`).
    An audio file that no transcript line names (an empty or missing .trans.txt) is a problem too."""
    rows, problems = [], []
    for split in splits.split(","):
        split_dir = Path(root) / split
        if not split_dir.is_dir():
            raise _layout_error(Path(root), split_dir, LIBRISPEECH_LAYOUT + " (<split>: --train_split, --valid_split)")
        listed = set()
        # Strings, not Path objects: at 281 k files pathlib's joins and comparisons were the bulk of
        # a cached re-check. Sorted by path components, hidden files included, as Path.glob gives them.
        for trans in _glob(split_dir, "*.trans.txt"):
            folder, name = os.path.split(trans)
            prefix = name[: -len(".trans.txt")]
            for n, line, raw in _lines(trans):
                where = f"{trans}:{n}"
                if line is None:
                    problems.append({"entry": where, "reason": "invalid UTF-8 in transcript", "detail": repr(raw[:80])})
                    # its audio is named by this line: not reported a second time as unlisted
                    listed.add(os.path.join(folder, f"{raw.split(b' ', 1)[0].decode('ascii', 'replace')}.flac"))
                    continue
                if not line.strip():
                    continue
                utt_id, _, text = line.strip().partition(" ")
                if not LIBRISPEECH_ID.match(utt_id) or not utt_id.startswith(prefix + "-"):
                    problems.append({"entry": where, "reason": "malformed line", "detail": line[:80]})
                    continue
                path = os.path.join(folder, f"{utt_id}.flac")
                listed.add(path)
                rows.append(dict(id=utt_id, path=path, text=text.strip(), speaker=utt_id.split("-")[0], where=where))
        for audio in _glob(split_dir, "*.flac"):
            if audio not in listed:
                folder, name = os.path.split(audio)
                trans = name.rsplit("-", 1)[0] + ".trans.txt"
                problems.append({"entry": audio, "reason": "audio without a transcript line",
                                 "detail": f"not named in {trans}"
                                           + ("" if os.path.isfile(os.path.join(folder, trans)) else " (missing)")})
    return rows, problems


def _glob(split_dir: Path, pattern: str) -> list[str]:
    """`<split_dir>/*/*/<pattern>` as strings, in the order of `sorted(split_dir.glob(...))`."""
    try:
        found = glob.glob(os.path.join(glob.escape(str(split_dir)), "*", "*", pattern), include_hidden=True)
    except TypeError:  # Python 3.10: no include_hidden
        found = [str(p) for p in split_dir.glob(f"*/*/{pattern}")]
    return sorted(found, key=lambda p: p.split(os.sep))


def scan_ljspeech(root: str | Path) -> tuple[list[dict], list[dict]]:
    """`<root>/metadata.csv` lines `id|raw text|normalized text` (the normalized one is used) and
    `<root>/wavs/<id>.wav`. A byte-order mark is accepted; an id that is a path is refused."""
    rows, problems = [], []
    metadata = Path(root) / "metadata.csv"
    if not metadata.is_file():
        raise _layout_error(Path(root), metadata, LJSPEECH_LAYOUT)
    for n, line, raw in _lines(metadata, encoding="utf-8-sig"):
        where = f"{metadata}:{n}"
        if line is None:
            problems.append({"entry": where, "reason": "invalid UTF-8 in transcript", "detail": repr(raw[:80])})
            continue
        if not line.strip():
            continue
        fields = line.split("|")
        if len(fields) not in (2, 3) or not fields[0].strip():
            problems.append({"entry": where, "reason": "malformed line", "detail": line[:80]})
            continue
        utt_id = fields[0].strip()
        if "/" in utt_id or "\\" in utt_id or utt_id.startswith(".") or Path(utt_id).is_absolute():
            problems.append({"entry": where, "reason": "id is a path (outside wavs/)", "detail": utt_id[:80]})
            continue
        rows.append(dict(id=utt_id, path=str(Path(root) / "wavs" / f"{utt_id}.wav"), text=fields[-1].strip(),
                         speaker="ljspeech", where=where))
    return rows, problems


def audiofolder_metadata(folder: Path) -> Path | None:
    """`folder`'s audiofolder metadata file (`AUDIOFOLDER_LAYOUT`), or None. A metadata.csv whose first
    line holds a '|' is LJSpeech's; a folder with both files is refused (`datasets` refuses it too)."""
    found = [folder / name for name in METADATA_FILES if (folder / name).is_file()]
    if len(found) == 2:
        raise DataError(f"{folder}: both metadata.csv and metadata.jsonl: keep one (the {AUDIOFOLDER_LAYOUT})")
    if not found:
        return None
    if found[0].name == "metadata.csv":
        with open(found[0], "rb") as f:
            if b"|" in f.readline():
                return None
    return found[0]


def _metadata_rows(metadata: Path) -> tuple[list, list[tuple[str, dict | None]]]:
    """(the columns, [(where, {column: value}, or None for a malformed line)]) of an audiofolder's metadata:
    CSV with a header line (as `datasets` reads it, with pandas), or JSON lines (the columns: every key
    of any line; a key a line lacks is null, as `datasets`' JSON reader fills it)."""
    if metadata.suffix == ".csv":
        lines = [(n, line) for n, line, _ in _lines(metadata, encoding="utf-8-sig")]
        bad = next((n for n, line in lines if line is None), None)
        if bad is not None:
            raise DataError(f"{metadata}:{bad}: invalid UTF-8; save it as UTF-8 (the {AUDIOFOLDER_LAYOUT})")
        lines = [(n, line) for n, line in lines if line.strip()]
        if not lines:
            raise DataError(f"{metadata}: empty, not even a header line; expected the {AUDIOFOLDER_LAYOUT}")
        header = next(csv.reader([lines[0][1]]))
        out = []
        for n, line in lines[1:]:
            fields = next(csv.reader([line]))
            out.append((f"{metadata}:{n}", dict(zip(header, fields)) if len(fields) == len(header) else None))
        return header, out
    out, columns = [], {}
    for n, line, _ in _lines(metadata):
        if line is not None and not line.strip():
            continue
        try:
            row = json.loads(line) if line is not None else None
        except ValueError:
            row = None
        out.append((f"{metadata}:{n}", row if isinstance(row, dict) else None))
        columns.update(dict.fromkeys(row if isinstance(row, dict) else ()))
    return list(columns), [(where, row and {c: row.get(c) for c in columns}) for where, row in out]


def _one_of(metadata: Path, columns: list, names: tuple[str, ...], required: bool) -> str | None:
    """The one column of `names` that `columns` has (None if none and not `required`); a one-line refusal
    when it has none that is required, or several."""
    have = [c for c in names if c in columns]
    if len(have) > 1 or (required and not have):
        raise DataError(f"{metadata}: its columns ({', '.join(map(str, columns)) or 'none'}) have "
                        f"{'both ' + ' and '.join(have) if have else 'no ' + ' or '.join(names)}; expected one "
                        f"(the {AUDIOFOLDER_LAYOUT})")
    return have[0] if have else None


def scan_audiofolder(folder: str | Path, text: bool = True) -> tuple[list[dict], list[dict]]:
    """An audiofolder (`AUDIOFOLDER_LAYOUT`): rows from its metadata file, the id each file's path inside
    the folder without its extension ('/' as '-'). A header without file_name, or (`text`: the
    recipe reads transcripts) without a text column, is a one-line `DataError`; a line of the wrong
    shape, a file_name that leaves the folder (absolute, '..', a URL: `datasets` refuses them too), a
    file named twice, an empty transcript (`text`) or speaker cell are problems, named or skipped."""
    folder = Path(folder)
    metadata = audiofolder_metadata(folder)
    columns, lines = _metadata_rows(metadata)
    _one_of(metadata, columns, ("file_name",), True)
    text_col = _one_of(metadata, columns, ("text", "transcription"), text)
    speaker_col = _one_of(metadata, columns, ("speaker", "speaker_id"), False)
    rows, problems, seen = [], [], {}
    for where, row in lines:
        if row is None:
            problems.append({"entry": where, "reason": "malformed line", "detail": f"expected {', '.join(columns)}"})
            continue
        name = row["file_name"] if isinstance(row["file_name"], str) else ""
        rel = os.path.normpath(name).replace("\\", "/")
        if not name.strip() or "://" in name or os.path.isabs(name) or rel == ".." or rel.startswith("../"):
            problems.append({"entry": where, "reason": "file_name outside the folder", "detail": str(row["file_name"])[:80]})
            continue
        if rel in seen:
            problems.append({"entry": where, "reason": "duplicate file", "detail": f"{name} (also {seen[rel]})"})
            continue
        seen[rel] = where
        transcript = row[text_col] if text_col else ""
        speaker = row[speaker_col] if speaker_col else folder.name
        if text and not (isinstance(transcript, str) and transcript.strip()):
            problems.append({"entry": where, "reason": "empty transcript", "detail": name[:80]})
        elif speaker is None or not str(speaker).strip():
            problems.append({"entry": where, "reason": f"no {speaker_col}", "detail": name[:80]})
        else:
            rows.append(dict(id=os.path.splitext(rel)[0].replace("/", "-"), path=str(folder / rel),
                             text=str(transcript or "").strip(), speaker=str(speaker).strip(), where=where))
    return rows, problems


def scan_corpus(root: str | Path, splits: str | None, text: bool = True) -> tuple[list[dict], list[dict]]:
    """The rows of `splits` (comma-joined subfolders; None: the whole folder), each an audiofolder
    (`scan_audiofolder`) where it has the metadata, else LibriSpeech (splits) or LJSpeech (None)."""
    if splits is None:
        return scan_audiofolder(root, text) if audiofolder_metadata(Path(root)) else scan_ljspeech(root)
    rows, problems = [], []
    for split in splits.split(","):
        found = (scan_audiofolder(Path(root) / split, text) if audiofolder_metadata(Path(root) / split)
                 else scan_librispeech(root, split))
        rows, problems = rows + found[0], problems + found[1]
    return rows, problems


# ---------------------------------------------------------------------------------------------
# Checking one entry
# ---------------------------------------------------------------------------------------------


def verdict(row: dict, facts: dict, policy: DataPolicy) -> tuple[str | None, dict]:
    """(reason the entry is unusable or None, {sample_rate, duration in s, digest[, detail]}) from the file's
    facts (`common.data.datacheck.audio_facts`) and the row's transcript."""
    if "error" in facts:
        return facts["error"], {k: v for k, v in facts.items() if k == "detail"}
    sr, frames, channels = facts["sample_rate"], facts["frames"], facts["channels"]
    out = {"sample_rate": sr, "duration": frames / sr, "digest": facts["digest"]}
    if channels != 1:
        return "multi-channel audio", {**out, "detail": f"{channels} channels"}
    if frames == 0:
        return "empty audio", out
    if facts.get("silent"):  # full mode only
        return "empty audio", {**out, "detail": "silent or non-finite samples"}
    if sr != policy.sample_rate and policy.wrong_sample_rate != "resample":
        return "wrong sample rate", {**out, "detail": f"{sr} Hz, expected {policy.sample_rate}"}
    if out["duration"] < policy.min_seconds:
        return "too short", {**out, "detail": f"{out['duration']:.2f} s < {policy.min_seconds} s"}
    if out["duration"] > policy.max_seconds:
        return "too long", {**out, "detail": f"{out['duration']:.2f} s > {policy.max_seconds} s"}
    if policy.charset is not None:
        if not row["text"]:
            return "empty transcript", out
        outside = sorted(set(row["text"]) - set(policy.charset))
        if outside:
            return "characters outside the symbol table", {**out, "detail": "".join(outside)}
    return None, out


def check_entry(row: dict, policy: DataPolicy) -> tuple[str | None, dict]:
    """One entry, read in this process with `policy.data_check` (no cache)."""
    return verdict(row, audio_facts(row["path"], policy.data_check), policy)


def validate(rows: list[dict], problems: list[dict], policy: DataPolicy, *, workers: int | None = None,
             cache: Path | None = None, stats: dict[str, tuple[int, int]] | None = None,
             ) -> tuple[list[dict], list[dict]]:
    """Good rows (sorted by id, with duration and sample_rate) and every problem found, in the
    order of `rows`. The files are read by `workers` processes (None: every core; the result does
    not depend on it), with facts cached in `cache` (see `common.data.datacheck.check_files`)."""
    problems = list(problems)
    unique, seen = [], set()
    for row in rows:
        if row["id"] in seen:
            unique.append((row, None))
            continue
        seen.add(row["id"])
        unique.append((row, row["path"]))
    paths = [p for _, p in unique if p is not None]
    start = time.monotonic()
    facts, n_read, n_cached = check_files(paths, policy.data_check, stats=stats, cache=cache, workers=workers)
    if paths:
        logger.info(f"data check ({policy.data_check}): read {n_read} of {len(paths)} audio files "
                    f"({n_cached} known from the cache) in {time.monotonic() - start:.1f} s")
    good, it = [], iter(facts)
    for row, path in unique:
        if path is None:
            problems.append({"entry": row["where"], "reason": "duplicate utterance id", "detail": row["id"]})
            continue
        reason, out = verdict(row, next(it), policy)
        if reason:
            problems.append({"entry": row["where"], "reason": reason, "id": row["id"], **out})
        else:
            good.append({k: v for k, v in row.items() if k != "where"} | out)
    good.sort(key=lambda r: r["id"])
    return good, problems


def report(problems: list[dict], source: str) -> str:
    counts = Counter(p["reason"] for p in problems)
    lines = [f"{len(problems)} unusable entries in {source} "
             f"({', '.join(f'{n} {reason}' for reason, n in counts.most_common())}):"]
    for p in problems:
        detail = f" ({p['detail']})" if p.get("detail") else ""
        lines.append(f"  {p['entry']}: {p['reason']}{detail}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Once per output folder
# ---------------------------------------------------------------------------------------------


def _fingerprint(listing: dict[str, Stamp], policy: DataPolicy, salt: str = "") -> str:
    # Every launch lists and stats every file (`list_files`, concurrent stats); nothing of the
    # listing is cached across launches. A cache keyed by folder mtimes would skip the stats, but a
    # file rewritten in place (same name) leaves its folder's mtime unchanged, and the old manifest
    # (old durations, a file now corrupt) would be reused silently. One stat per file is the price
    # of noticing that; the stats are reused by the check, which never stats a file again.
    h = hashlib.blake2b(json.dumps(asdict(policy), sort_keys=True).encode() + salt.encode(), digest_size=8)
    for path, (size, mtime_ns, ctime_ns) in listing.items():
        h.update(f"{path}\0{size}\0{mtime_ns}\0{ctime_ns}\n".encode())
    return h.hexdigest()


def prepare_manifest(output_dir: str | Path, name: str, root: str | Path, policy: DataPolicy,
                     splits: str | None = None, is_main_process: bool = True,
                     workers: int | None = None, seal: Callable[[Path], None] | None = None,
                     text: bool = True) -> datasets.Dataset:
    """Validated manifest of a LibriSpeech split (`splits` given) or an LJSpeech folder (`splits`
    None), or of an audiofolder in their place (`scan_corpus`; `text`: the recipe reads transcripts,
    so its metadata needs them), as a `datasets.Dataset` with columns id, path, text, speaker,
    duration, sample_rate, digest (`common.data.datacheck.content_digest`).

    Every rank calls it (no collective): one validates, with `workers` processes (None: every
    core this process may use), the others wait for its result. `seal(folder)`, when given, writes
    the folder's marker of digests last (`common.training.sealing.seal_export`, passed by
    `common.data.source`): what lets another tool trust the manifest it reads back (`read_manifest`).
    """
    root = Path(root)
    parts = splits.split(",") if splits else ["."] if audiofolder_metadata(root) else ["metadata.csv", "wavs"]
    listing = list_files([root / part for part in parts])
    # an audiofolder's scan depends on `text` too (a missing transcript column is refused or not)
    salt = f"text={text}" if any(audiofolder_metadata(root / part) for part in parts if part != "metadata.csv") else ""
    final = Path(output_dir) / "data" / f"{name}-{_fingerprint(listing, policy, salt)}"
    cache = Path(output_dir) / "data" / f"{name}.check-{policy.data_check}-v{CACHE_VERSION}.jsonl"

    def build(tmp: Path) -> None:
        rows, problems = scan_corpus(root, splits, text)
        good, problems = validate(rows, problems, policy, workers=workers, cache=cache, stats=listing)
        (tmp / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good))
        (tmp / "problems.jsonl").write_text("".join(json.dumps(p) + "\n" for p in problems))
        if seal is not None:
            seal(tmp)

    prepare_once(final, build)
    rows = [json.loads(line) for line in (final / "manifest.jsonl").read_text().splitlines()]
    problems = [json.loads(line) for line in (final / "problems.jsonl").read_text().splitlines()]
    source = f"{root}" + (f" [{splits}]" if splits else "")
    if problems and policy.on_bad_data == "error":
        if is_main_process:
            raise DataError(report(problems, source) + f"\n(list in {final / 'problems.jsonl'}; "
                            f"--on_bad_data skip drops them)")
        # The main process prints the report once; its exit makes the launcher stop this process.
        # Exiting first would let the launcher kill the main process before it printed anything.
        time.sleep(REPORT_GRACE_S)
        raise SystemExit(1)
    if problems and is_main_process:
        counts = Counter(p["reason"] for p in problems)
        logger.warning(f"skipping {len(problems)} of {len(rows) + len(problems)} entries in {source}: "
                       + ", ".join(f"{n} {reason}" for reason, n in counts.most_common())
                       + f" (list in {final / 'problems.jsonl'})")
    if not rows:
        raise DataError(f"no usable entries in {source}: expected the "
                        f"{LJSPEECH_LAYOUT if not splits else LIBRISPEECH_LAYOUT}, or the {AUDIOFOLDER_LAYOUT}")
    return datasets.Dataset.from_list(rows)


def read_manifest(folder: str | Path, columns: tuple[str, ...] = ("id", "text")) -> list[dict]:
    """The rows of a manifest folder `prepare_manifest` wrote, read back by another tool (the TTS score
    reads its ASR judge's training sentences): every line a JSON object whose `columns` hold text, and
    at least one (training never starts on an empty manifest: `prepare_manifest` refuses it, so an
    empty one was emptied since). Anything else is a `DataError` of one line naming the file and line."""
    path = Path(folder) / "manifest.jsonl"
    fix = f"it is not as the data check wrote it: delete {folder} and re-launch the run that wrote it (it is rebuilt)"
    if not path.is_file():
        what = "a folder" if path.is_dir() else "not a regular file" if path.exists() else "missing"
        raise DataError(f"{path}: {what}, not the manifest; {fix}")
    rows = []
    for n, line, raw in _lines(path):
        try:
            row = json.loads(line) if line is not None else None
        except ValueError:  # a blank line too
            row = None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{n}: not a JSON object ({(line if line is not None else repr(raw))[:60]!r}); {fix}")
        for column in columns:
            if not isinstance(row.get(column), str):
                what = "missing" if column not in row else f"{json.dumps(row[column])[:40]}, not text"
                raise DataError(f"{path}:{n}: its {column!r} is {what}; {fix}")
        rows.append(row)
    if not rows:
        raise DataError(f"{path}: no rows (a training manifest never has none); {fix}")
    return rows


def manifest_summary(manifest: datasets.Dataset) -> dict:
    """What a checkpoint records about its training data, to refuse resuming on other data:
    utterance count, hours, a fingerprint of (id, duration, text) over the sorted rows, and
    `contents`, one of the files' content digests (`common.data.datacheck.content_digest`): a file
    replaced by other audio of the same length changes it."""
    # Plain lists through Arrow: iterating a Dataset column item by item took 5 s per 50 k rows.
    cols = manifest.select_columns([c for c in ("id", "duration", "text", "digest") if c in manifest.column_names]).to_dict()
    h = hashlib.blake2b(digest_size=8)
    for utt_id, duration, text in zip(cols["id"], cols["duration"], cols.get("text", [""] * len(manifest))):
        h.update(f"{utt_id}\0{duration!r}\0{text}\n".encode())
    summary = {"utterances": len(manifest), "hours": sum(cols["duration"]) / 3600, "fingerprint": h.hexdigest()}
    if "digest" in cols:
        summary["contents"] = _contents(cols["id"], cols["digest"])
    return summary


def _contents(ids: list[str], digests: list[str]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for utt_id, digest in zip(ids, digests):
        h.update(f"{utt_id}\0{digest}\n".encode())
    return h.hexdigest()


def _hours(summary: dict) -> str:
    """"1.2345 h, " where the summary knows its hours (a stream's does not: its shards are not read ahead)."""
    return f"{summary['hours']:.4f} h, " if "hours" in summary else ""


def data_change(was: dict, now: dict, manifests: Path) -> str | None:
    """Why training data summarized by `now` (`manifest_summary`) is not the data `was`, or None
    when it is the same. Keys only one side has are not compared (a checkpoint from before the
    content fingerprint still resumes). `manifests` (`<output_dir>/data`) holds the manifests of
    earlier launches: when both are still there, the changed files are counted and one is named."""
    keys = was.keys() & now.keys() if was and now else set()
    if "shards" in keys and "shard_files" not in keys:
        keys -= {"fingerprint"}  # a stream checkpoint from before content digests: its fingerprint followed file times
    if all(was[k] == now[k] for k in keys):
        return None
    if "shard_files" in keys and was["shard_files"] != now["shard_files"]:
        return f"training data changed: {shard_change(was['shard_files'], now['shard_files'])}"
    if "fingerprint" not in keys or was["fingerprint"] != now["fingerprint"] or was["utterances"] != now["utterances"]:
        return (f"training data changed: checkpoint {was['utterances']} utterances ({_hours(was)}fingerprint "
                f"{was['fingerprint']}) != now {now['utterances']} ({_hours(now)}fingerprint {now['fingerprint']})")
    # Same ids, durations and transcripts: some files hold other audio. Which ones is found in the
    # manifests of the two launches (read only here, on the refusal path).
    rows = {}
    for m in sorted(manifests.glob("*/manifest.jsonl")):
        lines = [json.loads(line) for line in m.read_text().splitlines()]
        if lines and "digest" in lines[0]:
            rows.setdefault(_contents([r["id"] for r in lines], [r["digest"] for r in lines]), lines)
    fingerprints = f"content fingerprint {was['contents']} != now {now['contents']}"
    if was["contents"] not in rows or now["contents"] not in rows:
        return f"training data changed: the audio files' contents changed ({fingerprints})"
    old = {r["id"]: r["digest"] for r in rows[was["contents"]]}
    changed = [r["path"] for r in rows[now["contents"]] if old.get(r["id"]) != r["digest"]]
    return (f"training data changed: {len(changed)} files' contents changed, e.g. {changed[0]} "
            f"(same ids, durations and transcripts; {fingerprints})")


def shard_change(was: dict[str, str], now: dict[str, str]) -> str:
    """Which of a `datasets` source's files ({name: content digest}, `common.data.stream.shard_files`)
    appeared, vanished or changed, e.g. "shard train-00003.parquet appeared; 1 shard changed:
    train-00001.parquet (its content digest differs)"."""
    def names(what: list[str]) -> str:
        return ", ".join(what[:3]) + (f" and {len(what) - 3} more" if len(what) > 3 else "")

    parts = []
    for what, found in (("appeared", sorted(now.keys() - was.keys())), ("vanished", sorted(was.keys() - now.keys())),
                        ("changed (its content digest differs)",
                         sorted(k for k in was.keys() & now.keys() if was[k] != now[k]))):
        if found:
            parts.append(f"{len(found)} shard{'s' if len(found) > 1 else ''} {what}: {names(found)}")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# Reading a corpus folder without the check (tests, tools; training uses `prepare_manifest`)
# ---------------------------------------------------------------------------------------------


def read_librispeech(root: str | Path, splits: str) -> datasets.Dataset:
    """LibriSpeech-layout manifest without the validation pass (any problem is an error):
    columns id, path, text, speaker, duration (seconds), sample_rate; sorted by id."""
    rows, problems = scan_librispeech(root, splits)
    return _with_durations(rows, problems, f"{root} [{splits}]")


def split_manifest(manifest: datasets.Dataset, num_valid: int, num_test: int) -> dict[str, datasets.Dataset]:
    """A single-voice corpus split by sorted id (the TTS and vocoder recipes': the same --num_test
    holds out the same utterances in both): the last `num_test` ids are test, the `num_valid` before
    them validation, the rest training."""
    n = len(manifest)
    n_train = n - num_valid - num_test
    if n_train < 1:
        raise UsageError(f"{n} utterances leave none for training (--num_valid {num_valid}, --num_test {num_test}): "
                         f"lower them, or give more utterances")
    return {"train": manifest.select(range(n_train)), "validation": manifest.select(range(n_train, n - num_test)),
            "test": manifest.select(range(n - num_test, n))}


def read_ljspeech(root: str | Path) -> datasets.Dataset:
    """LJSpeech-layout manifest (`metadata.csv` + `wavs/`), same columns as `read_librispeech`."""
    rows, problems = scan_ljspeech(root)
    return _with_durations(rows, problems, str(root))


def read_corpus(root: str | Path, splits: str | None = None, text: bool = True) -> datasets.Dataset:
    """A folder's manifest in whichever layout it is (`scan_corpus`: an audiofolder, else LibriSpeech
    for `splits`, LJSpeech for None), same columns as `read_librispeech`."""
    rows, problems = scan_corpus(root, splits, text)
    return _with_durations(rows, problems, f"{root}" + (f" [{splits}]" if splits else ""))


def _with_durations(rows: list[dict], problems: list[dict], source: str) -> datasets.Dataset:
    if problems:
        raise DataError(report(problems, source))
    for row in rows:
        del row["where"]  # the scan's bookkeeping
        info = sf.info(row["path"])
        row.update(duration=info.frames / info.samplerate, sample_rate=info.samplerate)
    rows.sort(key=lambda r: r["id"])
    return datasets.Dataset.from_list(rows)
