"""Snapshots of a SpeechBrain training at fixed wall-clock minutes, for benchmarks/peers/asr.py.

Python imports `sitecustomize` at start-up from the first folder on sys.path that holds one; asr.py
puts this folder first on SpeechBrain's PYTHONPATH and sets PEER_T0 (the launch's `time.time()`),
PEER_POINTS (minutes, comma-separated, ascending) and PEER_SNAPSHOTS (a folder). After each training
batch (`Brain.fit_batch`, the recipe itself untouched), once PEER_T0 + a point has passed, every
recoverable of the recipe's checkpointer (model, normalizer, scheduler, counter) is saved into
PEER_SNAPSHOTS/CKPT+min<point>/ by a Checkpointer of its own: the recipe's end-of-epoch pruning, which
keeps the 10 best validation WERs, never sees those folders. After the last point the process ends
(exit 0): the budget is spent. Without PEER_SNAPSHOTS this file does nothing.
"""

import os

if os.environ.get("PEER_SNAPSHOTS"):
    import json
    import time

    import speechbrain.core
    from speechbrain.utils.checkpoints import Checkpointer

    _t0 = float(os.environ["PEER_T0"])
    _points = [float(p) for p in os.environ["PEER_POINTS"].split(",")]
    _fit_batch = speechbrain.core.Brain.fit_batch
    _steps = [0]

    def _fit_batch_with_snapshots(self, batch):
        loss = _fit_batch(self, batch)
        _steps[0] += 1
        minutes = (time.time() - _t0) / 60
        while _points and minutes >= _points[0]:
            point = _points.pop(0)
            saver = Checkpointer(os.environ["PEER_SNAPSHOTS"], recoverables=self.checkpointer.recoverables)
            saver.save_checkpoint(end_of_epoch=False, meta={"minutes": minutes, "point": point, "batches": _steps[0],
                                        "optimizer_steps": self.optimizer_step}, name=f"min{point:g}")
            with open(os.path.join(os.environ["PEER_SNAPSHOTS"], "snapshots.jsonl"), "a") as f:
                f.write(json.dumps({"point": point, "minutes": round(minutes, 3), "batches": _steps[0],
                                    "optimizer_steps": self.optimizer_step}) + "\n")
            if not _points:
                os._exit(0)  # the budget is spent; asr.py ends the data-loading workers with the session
        return loss

    speechbrain.core.Brain.fit_batch = _fit_batch_with_snapshots
