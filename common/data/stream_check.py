"""The stream's data check: every row of every parquet shard checked once (`check_shards`), its verdicts
cached per shard, so that a bad row is refused in one line naming its shard and row, or left out
(`Shard.skip`) by a rule of the shard's content alone: the batches stay the same on every launch and
rank (`common.data.stream`). `label_problem` and `MIN_SECONDS` are the rules a map-style `datasets`
source's rows are held to as well (`common.data.source`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import re
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from common.data.stream import BadAudioCell, Shard, audio_source
from common.training.faults import RunError

logger = logging.getLogger(__name__)

CHECK_VERSION = 3  # bump when what a shard's check finds changes meaning (older results are ignored)
# s: audio from a `datasets` source shorter than this is "too short" (a folder's has --min_seconds): the
# front ends' analysis windows are 25-46 ms, and a 1-sample clip crashed their padding mid-run.
MIN_SECONDS = 0.05


def label_problem(labels: dict) -> list | None:
    """[reason, detail] when a label cell (`EXTRA_COLUMNS`: {key: value}, e.g. a speaker) is null or
    blank (it would train as the speaker "None" or ""), else None."""
    for key, value in labels.items():
        if value is None or (isinstance(value, str) and not value.strip()):
            return [f"no {key}", f"its --{key}_column_name cell is {'null' if value is None else 'blank'}"]
    return None


def check_shards(shards: list[Shard], columns: dict[str, str | None], out_dir: str | Path, *,
                 mode: str = "header", on_bad_data: str = "error", is_main_process: bool = True,
                 workers: int | None = None) -> list[Shard]:
    """`shards` with their unusable rows in `Shard.skip` ("skip", counts logged), or a one-line
    refusal naming the first of them ("error"), as the folder data check does (`common.data.manifest`).

    A row is unusable when its audio cell is not encoded bytes or a regular file's path
    (`audio_source`: never opened then), or, with `mode` (`--data_check`) "header", its audio does
    not decode (header and last block, as `common.data.datacheck`), has no samples or several channels
    (refused, as from a folder), or, with a text column, its
    transcript is not a non-empty string; "full" decodes every sample and also finds silent and
    non-finite audio. The verdict depends on the row's content alone, never on the rank, the launch
    or the pool size, so the rows dropped (and with them every batch) are the same on every launch
    and rank: a run that skips resumes exactly.

    Each shard is read once: its result is appended to `<out_dir>/stream.check-<mode>-v<N>.jsonl`,
    keyed by its path, content digest and file times (`local_key`) and columns, as soon as it is known (a killed check
    resumes; a rewritten shard is read again, alone). The whole result, `problems.jsonl`, is built
    once in `<out_dir>/stream-check-<mode>-<digest>/` by one process while the others wait
    (`common.training.prepare.prepare_once`), so a re-launch opens no shard. `workers` processes read the
    shards (None: every core this process may use; the result does not depend on it)."""
    from common.data.datacheck import MODES, default_workers
    from common.training.prepare import prepare_once

    if mode not in MODES or on_bad_data not in ("error", "skip"):
        raise ValueError(f"mode must be one of {MODES} and on_bad_data error or skip, not {mode!r}, {on_bad_data!r}")
    labels = sorted(f"{k}={v}" for k, v in columns.items() if k not in ("audio", "text", "id", "duration") and v)
    key = f"{columns['audio']}\0{columns.get('text') or ''}" + "".join(f"\0{label}" for label in labels)
    h = hashlib.blake2b(f"{CHECK_VERSION}\0{mode}\0{key}\n".encode(), digest_size=8)
    local = {s.path: local_key(s.path, s.stamp) for s in shards}
    for s in shards:
        h.update(f"{s.path}\0{local[s.path]}\n".encode())
    out_dir = Path(out_dir)
    final = out_dir / f"stream-check-{mode}-{h.hexdigest()}"
    cache = out_dir / f"stream.check-{mode}-v{CHECK_VERSION}.jsonl"

    def build(tmp: Path) -> None:
        found = _check_all(shards, local, key, mode, cache, default_workers() if workers is None else workers)
        (tmp / "problems.jsonl").write_text("".join(
            json.dumps({"shard": s.path, "row": r, "reason": reason, "detail": detail}) + "\n"
            for s, bad in zip(shards, found) for r, reason, detail in bad))

    prepare_once(final, build)
    return _apply_verdicts(shards, final / "problems.jsonl", on_bad_data, is_main_process)


def _apply_verdicts(shards: list[Shard], problems_file: Path, on_bad_data: str, is_main_process: bool) -> list[Shard]:
    """`shards` with the rows `problems_file` lists in their `skip` ("skip": counts logged by the
    main process), or the one-line refusal naming the first ("error")."""
    from common.data.manifest import REPORT_GRACE_S, DataError

    problems = [json.loads(line) for line in problems_file.read_text().splitlines()]
    counts = Counter(p["reason"] for p in problems)
    what = (f"{len(problems)} unusable rows in {len({p['shard'] for p in problems})} of {len(shards)} shards "
            f"({', '.join(f'{n} {reason}' for reason, n in counts.most_common())})")
    if problems and on_bad_data == "error":
        if not is_main_process:  # the main process says it once; its exit makes the launcher stop us
            time.sleep(REPORT_GRACE_S)
            raise SystemExit(1)
        p = problems[0]
        raise DataError(f"{what}: {p['shard']} row {p['row']}: {p['reason']}"
                        + (f" ({p['detail']})" if p["detail"] else "")
                        + (f", and {len(problems) - 1} more" if len(problems) > 1 else "")
                        + f" (all in {problems_file}); re-encode or remove them, or --on_bad_data skip drops them")
    if problems and is_main_process:
        logger.warning(f"skipping {what} (list in {problems_file})")
    bad: dict[str, list[int]] = {}
    for p in problems:
        bad.setdefault(p["shard"], []).append(p["row"])
    return [replace(s, rows=s.rows - len(bad.get(s.path, ())), skip=tuple(sorted(bad.get(s.path, ()))))
            for s in shards]


def _check_all(shards: list[Shard], local: dict[str, str], key: str, mode: str, cache: Path, workers: int) -> list[list]:
    """[[row, reason, detail], ...] per shard, from `cache` or read (by `workers` processes)."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    from common.data.datacheck import Appender, worker_init

    known = _read_check_cache(cache)
    found = [known.get((s.path, local[s.path], key)) for s in shards]
    todo = [i for i, bad in enumerate(found) if bad is None]
    if not todo:
        return found
    audio, text, *named = key.split("\0")
    labels = [tuple(label.split("=", 1)) for label in named]  # (our key, the source's column)
    appender, pool = Appender(cache), None
    try:
        if workers == 1:
            results = ((i, _check_shard(shards[i].path, audio, text or None, mode, labels)) for i in todo)
        else:  # fork: the children read parquet and decode audio only (see common.data.datacheck._run)
            pool = ProcessPoolExecutor(min(workers, len(todo)), initializer=worker_init,
                                       mp_context=multiprocessing.get_context("fork"))
            futures = {pool.submit(_check_shard, shards[i].path, audio, text or None, mode, labels): i for i in todo}
            results = ((futures[f], f.result()) for f in as_completed(futures))
        for i, bad in results:
            found[i] = bad
            appender.append([((shards[i].path, local[shards[i].path], key), bad)])
    except BrokenProcessPool:
        raise RunError(f"a data-check worker died while reading one of {len(todo)} shards (out of memory, or a "
                       f"crash in libsndfile): run with fewer workers; the shards already checked are cached "
                       f"in {cache}") from None
    finally:
        appender.close()
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    logger.info(f"stream data check ({mode}): read {len(todo)} of {len(shards)} shards")
    return found


def _read_check_cache(path: Path) -> dict[tuple[str, str, str], list]:
    """Complete, well-formed lines [path, stamp, key, bad rows] of a check cache (a torn last line,
    from a killed check, is ignored)."""
    try:
        lines = path.read_bytes().split(b"\n")[:-1]
    except FileNotFoundError:
        return {}
    out = {}
    for line in lines:
        try:
            p, stamp, key, bad = json.loads(line)
        except (ValueError, TypeError):
            continue
        if isinstance(bad, list):
            out[(p, stamp, key)] = bad
    return out


def _check_shard(path: str, audio: str, text: str | None, mode: str, labels: list[tuple] = ()) -> list[list]:
    """[[row, reason, detail], ...] of one shard's unusable rows, read row group by row group;
    `labels`: (key, column) of each label (`EXTRA_COLUMNS`), whose every cell must hold a value."""
    import pyarrow.parquet as pq

    from common.data.datacheck import decoded_facts

    f, bad, r = pq.ParquetFile(path), [], 0
    for g in range(f.metadata.num_row_groups):
        for row in f.read_row_group(g, columns=[c for c in (audio, text, *(c for _, c in labels)) if c]).to_pylist():
            problem = label_problem({key: row[c] for key, c in labels})
            if problem is not None:
                pass  # a row without its label: its audio is not read
            elif text is not None and not isinstance(row[text], str):
                problem = ["transcript is not text", type(row[text]).__name__]
            elif text is not None and not row[text].strip():
                problem = ["empty transcript", ""]
            else:
                try:
                    facts = decoded_facts(audio_source(row[audio]), mode)
                except BadAudioCell as e:
                    facts = {"error": e.reason, "detail": e.detail}
                if "error" in facts:  # the detail names a BytesIO at an address that changes every run
                    problem = [facts["error"], re.sub(r"<_io\.BytesIO object at 0x[0-9a-f]+>", "its bytes",
                                                      facts.get("detail", "")).replace("\n", " ")]
                elif facts["channels"] != 1:  # refused, as from a folder (`common.data.manifest.verdict`)
                    problem = ["multi-channel audio", f"{facts['channels']} channels"]
                elif facts["frames"] == 0:
                    problem = ["empty audio", ""]
                elif facts.get("silent"):
                    problem = ["empty audio", "silent or non-finite samples"]
                elif facts["frames"] < MIN_SECONDS * facts["sample_rate"]:
                    problem = ["too short", f"{facts['frames']} samples < {MIN_SECONDS} s"]
            if problem:
                bad.append([r, *problem])
            r += 1
    return bad


def local_key(path: str, stamp: str) -> str:
    """The data check's cache key of a shard: its content digest plus its size and file times, so
    that a shard rewritten in place is checked again even where its sampled bytes are unchanged."""
    st = os.stat(path)
    return f"{stamp}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
