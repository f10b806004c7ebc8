"""The recipes on a `datasets` source (--dataset_name), on parquet shards that `datasets` itself
writes from the tiny corpus's audio files (as bytes). ASR through `accelerate launch`: streamed, a
SIGKILLed run re-launched ends bit-identical to an uninterrupted one in 1 and 2 processes, 2 → 1
processes uses the same global batches, changed shards refuse the resume; map-style trains and
resumes the same way; column, split and source mistakes are one line, exit code 2. BEST-RQ, TTS and
the vocoder: their build_data on the source (map-style and streamed), the streamed data check (a bad
row refused in one line or skipped with its count, checked once), and streamed kill/resume."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.config import parse_config
from common.training.faults import UsageError
from common.data.manifest import read_librispeech
from tests.conftest import suite_dir
from tests.harness.recipe_import import recipe_modules
from tests.harness.harness import (ROOT, assert_same_losses, assert_same_weights, last_flag_wins, metrics, python,
                                   resumed_positions, run)
from tests.recipes.test_asr import TINY
from tests.guarantees.test_elastic import ids_per_step

SPLITS = {"train": [20, 5, 23], "validation": [6]}  # rows per shard: uneven on purpose (48 and 6 utterances)
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # there is no Hub here: fail fast, never retry


def write_source(librispeech: Path, folder: Path) -> Path:
    """<folder>/data/{train,validation}-0000i-of-0000n.parquet, the layout `datasets` resolves into
    splits; columns id, audio (a datasets Audio column holding the FLAC bytes), sentence."""
    import datasets

    (folder / "data").mkdir(parents=True, exist_ok=True)
    for split, sizes in SPLITS.items():
        rows = [{"id": r["id"], "audio": {"bytes": Path(r["path"]).read_bytes(), "path": None}, "sentence": r["text"]}
                for r in read_librispeech(librispeech, split)]
        assert len(rows) == sum(sizes)
        start = 0
        for i, size in enumerate(sizes):
            ds = datasets.Dataset.from_list(rows[start : start + size]).cast_column("audio", datasets.Audio(decode=False))
            ds.to_parquet(str(folder / "data" / f"{split}-{i:05d}-of-{len(sizes):05d}.parquet"), batch_size=8)
            start += size
    return folder


@pytest.fixture(scope="module")
def source(tiny_corpus, tmp_path_factory) -> Path:
    return write_source(tiny_corpus / "librispeech", tmp_path_factory.mktemp("source"))


@pytest.fixture(scope="session")
def env(tmp_path_factory) -> dict:
    """One datasets cache for the test run, as a user has one: the runs of every test share it, and so
    share a fork server too (`datasets` reads HF_DATASETS_CACHE on import; tests/harness/harness.py)."""
    return {**OFFLINE, "HF_DATASETS_CACHE": str(suite_dir(tmp_path_factory) / "hf_cache")}


def args_for(source: Path, out: Path, *extra: str, streaming: bool = True) -> list[str]:
    """The test ASR model on `source`; streamed: 4 utterances a batch in 4 partitions (12 global
    batches an epoch), else batches of 16 s as in test_asr.py."""
    tiny = TINY if not streaming else [a for i, a in enumerate(TINY) if "--max_batch_seconds" not in TINY[max(0, i - 1) : i + 1]]
    stream = ["--streaming", "true", "--per_device_train_batch_size", "4", "--stream_partitions", "4",
              "--stream_block_rows", "8"] if streaming else []
    return last_flag_wins(["--dataset_name", str(source), "--text_column_name", "sentence", "--output_dir", str(out),
                           *tiny, "--eval_steps", "0", *stream, *extra])


asr = recipe_modules("asr", "train")


def source_cfg(source: Path, **changes):
    """The data-source settings as the recipe reads them (its Config, parsed as a command line)."""
    argv = ["--dataset_name", str(source), "--text_column_name", "sentence", "--streaming", "true",
            "--per_device_train_batch_size", "4", "--stream_partitions", "4", "--max_batch_seconds", "20"]
    for key, value in changes.items():
        argv += [f"--{key}", str(value)]
    return parse_config(asr.train.Config, last_flag_wins(argv), default_yaml=ROOT / "recipes" / "asr" / "config.yaml")


# ---------------------------------------------------------------------------------------------
# Mistakes: one line each (the command line's at parse time; the data's as UsageError, exit code 2)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,message", [
    (["--dataset_name", "x", "--data_dir", "."], "--dataset_name and --data_dir both name the training data: give one"),
    (["--streaming", "true"], "--streaming applies to a --dataset_name source"),
    (["--text_column_name", "sentence"], "--text_column_name applies to a --dataset_name source"),
    (["--dataset_name", "x", "--streaming", "true"], "--streaming needs --per_device_train_batch_size"),
    (["--dataset_name", "x", "--per_device_train_batch_size", "4"], "--per_device_train_batch_size sets streamed batches"),
    (["--dataset_name", "x", "--streaming", "true", "--per_device_train_batch_size", "4", "--num_buckets", "3"],
     "--num_buckets does not apply to a streamed source: drop it"),
    (["--dataset_name", "x", "--min_seconds", "1"], "--min_seconds does not apply to a --dataset_name source"),
    (["--dataset_name", "x", "--train_split", "dev"], "with --dataset_name use --train_split_name and --eval_split_name"),
    (["--dataset_name", "x", "--streaming", "true", "--per_device_train_batch_size", "4", "--train_fraction", "0.5"],
     "--train_subset and --train_fraction choose utterances by id"),
])
def test_settings_a_source_cannot_apply_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(asr.train.Config, argv, default_yaml=ROOT / "recipes" / "asr" / "config.yaml")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1


def test_a_plain_run_and_the_recipe_yaml_are_not_refused():
    """The recipe's YAML sets max_batch_seconds: what a plain run gets is not the user's change."""
    cfg = parse_config(asr.train.Config, ["--dataset_name", "x", "--streaming", "true",
                                          "--per_device_train_batch_size", "4"],
                       default_yaml=ROOT / "recipes" / "asr" / "config.yaml")
    assert cfg.streaming and cfg.max_batch_seconds == 20.0
    assert parse_config(asr.train.Config, [], default_yaml=ROOT / "recipes" / "asr" / "config.yaml").dataset_name is None


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("changes,message", [
    ({"audio_column_name": "wav"}, r"^--audio_column_name wav: no such column in .* \(it has id, audio, sentence\)$"),
    ({"text_column_name": "text"}, r"^--text_column_name text: no such column in .* \(it has id, audio, sentence\)$"),
    ({"train_split_name": "dev"}, r"^--dataset_name .* has no split 'dev' \(it has train, validation\): set "
                                  r"--train_split_name / --eval_split_name to one of them$"),
])
def test_column_and_split_mistakes_name_what_there_is(source, tmp_path, monkeypatch, streaming, changes, message):
    from common.data.source import load_split, open_stream

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path))
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    cfg = source_cfg(source, **changes, **({} if streaming else {"streaming": "false", "per_device_train_batch_size": "none",
                                                                  "stream_partitions": "none"}))
    with pytest.raises(UsageError, match=message):
        if streaming:
            open_stream(cfg, cfg.train_split_name, text=True, partitions=4)
        else:
            load_split(cfg, cfg.train_split_name)


def test_a_folder_without_data_files_is_one_line(tmp_path, monkeypatch):
    from common.data.source import load_split, open_stream

    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    (tmp_path / "empty").mkdir()
    cfg = source_cfg(tmp_path / "empty")
    for read in (lambda: open_stream(cfg, "train", text=True, partitions=4), lambda: load_split(cfg, "train")):
        with pytest.raises(UsageError, match=r"^--dataset_name .*empty: The directory at .* doesn't contain any data files$"):
            read()


@pytest.mark.slow
def test_a_missing_column_stops_the_recipe_in_one_line_with_exit_code_2(source, tmp_path, env):
    proc = python([ROOT / "recipes" / "asr" / "train.py",
                   *args_for(source, tmp_path / "out", "--text_column_name", "transcript", "--max_steps", "1")], env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"[rank 0] error: --text_column_name transcript: no such column in {source}/data/train-00000-of-00003.parquet "
        f"(it has id, audio, sentence)")


# ---------------------------------------------------------------------------------------------
# End to end: accelerate launch, SIGKILL, re-launch
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_streamed_1proc_killed_and_resumed_is_bit_identical_and_changed_shards_are_refused(source, tmp_path, env):
    """8 batches of ≤ 8 an epoch: 10 steps cross into epoch 1; killed after step 3, resumed reading
    with 2 data workers; validation streamed at steps 5 and 10. Then a shard rewritten without its
    last row refuses the resume, naming it."""
    data = tmp_path / "source"
    shutil.copytree(source, data)  # this test rewrites a shard
    extra = ["--max_steps", "10", "--save_steps", "1", "--eval_steps", "5", "--per_device_train_batch_size", "8"]
    cont, cut = tmp_path / "continuous", tmp_path / "interrupted"
    run("asr", 1, args_for(data, cont, *extra), env=env)
    run("asr", 1, args_for(data, cut, *extra), env=env, kill_after_checkpoint=3)
    log = run("asr", 1, args_for(data, cut, *extra, "--num_workers", "2"), env=env)
    assert "batch 8 utterances per process × accumulation 1 → 8 utterances per optimizer step" in log
    [(step, epoch, batch)] = resumed_positions(tmp_path / "interrupted.log")
    assert epoch == 0 and batch == step >= 3  # mid-epoch
    assert_same_weights(cont, cut)
    assert_same_losses(cont, cut)
    rows = metrics(cut)
    assert [r["step"] for r in rows] == list(range(1, 11)) and rows[-1]["epoch"] == 1
    assert [r["eval_wer"] for r in rows if "eval_wer" in r] == [r["eval_wer"] for r in metrics(cont) if "eval_wer" in r]
    assert len([r for r in rows if "eval_wer" in r]) == 2

    import pyarrow.parquet as pq

    shard = data / "data" / "train-00001-of-00003.parquet"
    pq.write_table(pq.read_table(shard).slice(0, 4), shard)  # its last row removed
    log = run("asr", 1, args_for(data, cut, *extra), env=env, expect_rc=1)
    assert "refusing to resume" in log and ("training data changed: 1 shard changed (its content digest differs): "
                                            "train-00001-of-00003.parquet") in log


@pytest.mark.slow
def test_unset_partitions_fill_the_batches_and_a_resume_keeps_them(source, tmp_path, env):
    """--stream_partitions unset, 48 rows in batches of 8: 2 partitions (64 would give batches of at
    most 1), recorded in the checkpoint; a re-launch with more steps resumes with them."""
    args = args_for(source, tmp_path / "out", "--max_steps", "2", "--save_steps", "1")
    i = args.index("--stream_partitions")
    args = args[:i] + args[i + 2 :]
    args[args.index("--per_device_train_batch_size") + 1] = "8"
    log = run("asr", 1, args, env=env)
    assert "6 batches of 8–8 an epoch in 2 partitions" in log and "streamed batches hold" not in log
    args[args.index("--max_steps") + 1] = "3"
    log = run("asr", 1, args, env=env)
    assert "refusing" not in log and len(resumed_positions(tmp_path / "out.log")) == 1
    assert [r["step"] for r in metrics(tmp_path / "out") if "step" in r] == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.accelerate_launch
def test_streamed_2proc_killed_and_resumed_is_bit_identical_and_continues_on_1(source, tmp_path, env):
    """2 processes, 12 batches of ≤ 4 an epoch (6 steps): 8 steps; killed after step 3 and resumed on
    2 processes: bit-identical; a copy of the same killed run resumed on 1 process (accumulation 2): the
    same utterances at every step, and here bit-identical too (two terms: halving is exact)."""
    extra = ["--max_steps", "8", "--save_steps", "1", "--dump_batch_ids", "true"]
    cont, cut, one = tmp_path / "continuous", tmp_path / "interrupted", tmp_path / "on_one"
    run("asr", 2, args_for(source, cont, *extra), env=env, launcher=False)  # the reference: forked (the guarantee is the cut run's)
    run("asr", 2, args_for(source, cut, *extra), env=env, kill_after_checkpoint=3, launcher=False)  # harness.KILL_LEG
    # The 2 → 1 case below starts from the same killed run: a copy of it as the kill left it (lock included)
    shutil.copytree(cut, one, symlinks=True)
    run("asr", 2, args_for(source, cut, *extra), env=env)
    assert len(resumed_positions(tmp_path / "interrupted.log")) == 1
    assert_same_weights(cont, cut)
    assert_same_losses(cont, cut)

    # 2 → 1 forked: the real launcher's elastic case is test_elastic's
    log = run("asr", 1, args_for(source, one, *extra), env=env, launcher=False)
    assert "checkpoint: 2 process(es) × accumulation 1; now: 1 × 2" in log
    [(step, epoch, batch)] = resumed_positions(tmp_path / "on_one.log")
    assert epoch == 0 and batch == 2 * step  # global micro-batches, mid-epoch
    steps = ids_per_step(cont)
    assert ids_per_step(one) == steps and len(steps) == 8
    assert sorted(i for s in range(1, 7) for i in steps[s]) == sorted(read_librispeech_ids(source))  # one epoch: each once
    assert_same_losses(cont, one)
    assert_same_weights(cont, one)


def read_librispeech_ids(source: Path) -> list[str]:
    import pyarrow.parquet as pq

    return [i for f in sorted((source / "data").glob("train-*.parquet")) for i in pq.read_table(f, columns=["id"])["id"].to_pylist()]


@pytest.mark.slow
@pytest.mark.accelerate_launch
def test_map_style_source_trains_resumes_and_decodes(source, tmp_path, env):
    """--dataset_name without --streaming: loaded whole, batches of 16 s as from a folder; killed
    after step 2 and resumed: bit-identical; decode.py reads the same source's split."""
    extra = ["--max_steps", "4", "--save_steps", "1"]
    cont, cut = tmp_path / "continuous", tmp_path / "interrupted"
    run("asr", 1, args_for(source, cont, *extra, streaming=False), env=env, launcher=False)  # the reference: forked (the guarantee is the cut run's)
    run("asr", 1, args_for(source, cut, *extra, streaming=False), env=env, kill_after_checkpoint=2, launcher=False)  # harness.KILL_LEG
    run("asr", 1, args_for(source, cut, *extra, streaming=False), env=env)
    assert len(resumed_positions(tmp_path / "interrupted.log")) == 1
    assert_same_weights(cont, cut)
    assert_same_losses(cont, cut)

    proc = python([ROOT / "recipes" / "asr" / "decode.py", "--checkpoint", cut, "--split", "validation"], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = (cut / "decode" / "final" / "validation-greedy.jsonl").read_text().splitlines()
    assert len(summary) == 6


def test_a_usage_error_exits_with_code_2_in_one_line():
    code = ("from common.training.faults import UsageError, run_main\n"
            "def main(): raise UsageError('--text_column_name t: no such column in s (it has a, b)')\n"
            "run_main(main)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    assert proc.stderr == "[rank 0] error: --text_column_name t: no such column in s (it has a, b)\n"


# ---------------------------------------------------------------------------------------------
# Every recipe on a source: its build_data, in this process (a real Accelerator on the CPU)
# ---------------------------------------------------------------------------------------------

RECIPES = ("best_rq", "tts", "vocoder")


def without(args: list[str], *keys: str) -> list[str]:
    """`args` less the `--key value` pairs of `keys`."""
    out, skip = [], False
    for a in args:
        if skip or a in keys:
            skip = not skip and a in keys
            continue
        out.append(a)
    return out


def recipe_args(recipe: str, source: Path, out: Path, *extra: str, streaming: bool = True) -> list[str]:
    """The recipe's test model on `source`: its TINY flags less those of a folder (and, streamed, of
    seconds-sized batches); 4 utterances a batch in 4 partitions when streamed."""
    tiny = {"best_rq": "tests.recipes.test_best_rq", "tts": "tests.recipes.test_tts",
            "vocoder": "tests.recipes.test_vocoder"}[recipe]
    args = without(__import__(tiny, fromlist=["TINY"]).TINY, "--num_valid", "--num_test", "--eval_steps",
                   *(["--max_batch_seconds"] if streaming else []))
    stream = ["--streaming", "true", "--per_device_train_batch_size", "4", "--stream_partitions", "4",
              "--stream_block_rows", "8"] if streaming else []
    text = ["--text_column_name", "sentence"] if recipe == "tts" else []
    return last_flag_wins(["--dataset_name", str(source), "--output_dir", str(out), *text, *args, *stream, *extra])


def build(recipe: str, argv: list[str], out: Path):
    """The recipe's RecipeData from its own `build_data`, as its train.py calls it."""
    from accelerate import Accelerator

    train = recipe_modules(recipe, "train").train
    cfg = parse_config(train.Config, argv, default_yaml=ROOT / "recipes" / recipe / "config.yaml")
    return train.build_data(cfg, Accelerator(cpu=True), out, global_batch=1, num_workers=0)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("recipe", ["tts", "vocoder"])
def test_a_recipe_refuses_the_settings_of_a_folder_or_what_it_does_not_read(recipe, capsys):
    train = recipe_modules(recipe, "train").train
    yaml = ROOT / "recipes" / recipe / "config.yaml"
    stream = ["--dataset_name", "x", "--streaming", "true", "--per_device_train_batch_size", "4",
              *(["--phonemizer_language", "en-us"] if recipe == "tts" else [])]  # a voice of one's own names it
    for given in (stream, [*stream[:2], *stream[6:]]):  # a stream's rows are checked, and a map-style source's
        cfg = parse_config(train.Config, [*given, "--on_bad_data", "skip", "--data_check", "full"], default_yaml=yaml)
        assert (cfg.on_bad_data, cfg.data_check) == ("skip", "full")
    cases = [([*stream[:2], *stream[6:], "--num_valid", "3"], "--num_valid applies to a --data_dir folder: with "
              "--dataset_name --eval_split_name validates and no test utterances are held out"),
             ([*stream, "--max_seconds", "9"], "--max_seconds does not apply to a --dataset_name source")]
    if recipe == "vocoder":
        cases.append(([*stream, "--text_column_name", "s"], "--text_column_name: this recipe reads no transcripts"))
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            parse_config(train.Config, argv, default_yaml=yaml)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("streaming", [True, False], ids=["streamed", "map-style"])
@pytest.mark.parametrize("recipe", ["tts", "vocoder"])
def test_tts_and_vocoder_build_their_data_from_a_source(recipe, streaming, source, tmp_path, offline):
    """build_data on the source: training batches of the source's utterances (resampled to the
    recipe's rate, as from a folder), the summary a checkpoint compares, the validation rows logged
    as samples; TTS: the symbol table of --symbols auto from the training transcripts."""
    import pyarrow.parquet as pq

    extra = ["--symbols", "auto"] if recipe == "tts" else []
    data = build(recipe, recipe_args(recipe, source, tmp_path / "out", *extra, streaming=streaming), tmp_path / "out")
    if recipe == "tts":
        cfg = SimpleNamespace(**data.recorded)  # what main records in the run's config
        texts = [t for f in sorted((source / "data").glob("train-*.parquet"))
                 for t in pq.read_table(f, columns=["sentence"])["sentence"].to_pylist()]
        assert cfg.symbols == "".join(sorted(set(" ".join(texts).lower())))
    batch = next(iter(data.train_loader))
    assert set(batch["ids"]) <= set(read_librispeech_ids(source))
    assert data.summary["utterances"] == 48
    assert "fingerprint" in data.summary and list(data.summary["shard_files"]) == [
        f"train-0000{i}-of-00003.parquet" for i in range(3)]  # each file's content digest, by name
    if streaming:
        assert len(batch["ids"]) == 4 and len(batch["durations"]) == 4
    rows = data.valid_rows(2)
    items = [data.valid_items.item(row) for row in rows]
    assert [item[0] for item in items] == [row["id"] for row in rows] and len(rows) == 2
    wav = items[0][-1] if recipe == "vocoder" else None
    if wav is not None:  # 16 kHz audio resampled to the recipe's 22 050 Hz
        from common.data.source import audio_seconds

        assert abs(len(wav) / 22050 - audio_seconds(rows[0]["audio"])) < 0.01


@pytest.fixture(scope="module")
def bad_source(source, tmp_path_factory) -> tuple[Path, str]:
    """`source` with row 2 of its second training shard no longer audio: (folder, that row's id)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("bad_source")
    shutil.copytree(source, folder, dirs_exist_ok=True)
    shard = folder / "data" / "train-00001-of-00003.parquet"
    table = pq.read_table(shard)
    audio = table.column("audio").to_pylist()
    audio[2] = {"bytes": b"not audio at all", "path": None}
    pq.write_table(table.set_column(table.schema.get_field_index("audio"), "audio",
                                    pa.array(audio, table.schema.field("audio").type)), shard)
    return folder, table.column("id")[2].as_py()


def test_a_streamed_bad_row_refuses_the_run_in_one_line(bad_source, tmp_path, offline):
    from common.training.faults import RunError

    folder, _ = bad_source
    with pytest.raises(RunError) as e:
        build("vocoder", recipe_args("vocoder", folder, tmp_path / "out"), tmp_path / "out")
    message = str(e.value)
    assert "\n" not in message and message.startswith("1 unusable rows in 1 of 3 shards (1 unreadable audio): ")
    assert f"{folder}/data/train-00001-of-00003.parquet row 2: unreadable audio" in message
    assert message.endswith("re-encode or remove them, or --on_bad_data skip drops them")


def test_a_streamed_bad_row_is_skipped_with_its_count_and_checked_once(bad_source, tmp_path, offline, caplog,
                                                                        monkeypatch):
    """--on_bad_data skip: the row is left out of the stream and of the transcripts (TTS's symbol
    table), the count logged; a second launch on the same output_dir reads no shard."""
    import common.data.stream_check
    from common.data.source import stream_column

    folder, bad_id = bad_source
    argv = recipe_args("tts", folder, tmp_path / "out", "--on_bad_data", "skip")
    with caplog.at_level(logging.INFO):
        data = build("tts", argv, tmp_path / "out")
    assert "skipping 1 unusable rows in 1 of 3 shards (1 unreadable audio)" in caplog.text
    assert "stream data check (header): read 3 of 3 shards" in caplog.text
    ids, texts = stream_column(data.source.splits["train"], "text")
    assert data.source.size("train") == len(ids) == len(texts) == 47 and bad_id not in ids
    epoch = [i for batch in data.train_loader for i in batch["ids"]]
    assert sorted(epoch) == sorted(ids)

    caplog.clear()
    read = []
    monkeypatch.setattr(common.data.stream_check, "_check_shard", lambda path, *a: read.append(path) or [])
    with caplog.at_level(logging.INFO):
        data = build("tts", argv, tmp_path / "out")
    assert read == [] and "stream data check" not in caplog.text and data.source.size("train") == 47
    assert "skipping 1 unusable rows in 1 of 3 shards (1 unreadable audio)" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_streamed_killed_and_resumed_is_bit_identical_in_every_recipe(recipe, source, tmp_path, env):
    """BEST-RQ, TTS and the vocoder streamed (ASR: above): 4 steps, killed after step 2, validation
    streamed at step 4. TTS and the vocoder: their scoring scripts then refuse the checkpoint without
    --data_dir (a source holds out no test utterances), rather than score another corpus."""
    extra = [*(["--stats_utterances", "20"] if recipe != "vocoder" else []),  # the vocoder has no statistics
             "--max_steps", "4", "--save_steps", "1", "--eval_steps", "4"]
    cont, cut = tmp_path / "continuous", tmp_path / "interrupted"
    run(recipe, 1, recipe_args(recipe, source, cont, *extra), env=env, timeout=1200)
    run(recipe, 1, recipe_args(recipe, source, cut, *extra), env=env, kill_after_checkpoint=2, timeout=1200)
    run(recipe, 1, recipe_args(recipe, source, cut, *extra), env=env, timeout=1200)
    assert len(resumed_positions(tmp_path / "interrupted.log")) == 1
    assert_same_weights(cont, cut)
    assert_same_losses(cont, cut, key="loss" if recipe != "vocoder" else "g_loss")
    evals = [{k: v for k, v in r.items() if k.startswith("eval_")} for r in metrics(cut) if "step" in r]
    assert evals == [{k: v for k, v in r.items() if k.startswith("eval_")} for r in metrics(cont) if "step" in r]
    assert evals[-1]
    if recipe in ("tts", "vocoder"):
        script = {"tts": ["score.py", "--split", "test"], "vocoder": ["evaluate.py"]}[recipe]
        proc = python([ROOT / "recipes" / recipe / script[0], "--checkpoint", cut / "final", *script[1:]], env=env,
                      timeout=600)
        assert proc.returncode == 2 and proc.stderr.endswith(
            f"was trained on --dataset_name {source}, which held out no test utterances: give --data_dir "
            f"(an LJSpeech-layout folder or an audiofolder{' of the same voice' if recipe == 'tts' else ''})\n"), \
            proc.stderr[-2000:]
