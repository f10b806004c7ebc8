"""Step timestamps for benchmarks/speechbrain/compare.py, on both sides alike.

Python imports `sitecustomize` at start-up from the first folder on sys.path that holds one;
compare.py puts this folder first on PYTHONPATH for both training runs and sets BENCH_STEP_LOG.
Then every optimizer step of every torch optimizer appends one JSON line
`{"step_end": perf_counter seconds}` (a global step post-hook: neither recipe is edited), and the
first line says the torch thread count the process trains with. With BENCH_SB_AUDIO set, each
SpeechBrain `Brain.fit_batch` first appends `{"audio_s": seconds of unpadded audio in the batch}`.
Without BENCH_STEP_LOG this file does nothing.
"""

import os

if os.environ.get("BENCH_STEP_LOG"):
    import json
    import time

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _file = []  # opened at the first line: `accelerate launch` is itself a Python process, training nothing

    def _write(row: dict) -> None:
        if not _file:  # one file per process, line-buffered
            _file.append(open(f"{os.environ['BENCH_STEP_LOG']}.{os.getpid()}", "a", buffering=1))
            _file[0].write(json.dumps({"torch_threads": torch.get_num_threads()}) + "\n")
        _file[0].write(json.dumps(row) + "\n")

    def _after_step(optimizer, args, kwargs):
        _write({"step_end": time.perf_counter()})

    register_optimizer_step_post_hook(_after_step)

    if os.environ.get("BENCH_SB_AUDIO"):
        import speechbrain.core

        _fit_batch = speechbrain.core.Brain.fit_batch
        _sample_rate = float(os.environ["BENCH_SB_AUDIO"])  # Hz

        def _timed_fit_batch(self, batch):
            wavs, wav_lens = batch[0], batch[1]  # (B, samples) padded; (B,) unpadded fraction
            _write({"audio_s": float((wav_lens * wavs.shape[1]).sum()) / _sample_rate})
            return _fit_batch(self, batch)

        speechbrain.core.Brain.fit_batch = _timed_fit_batch
