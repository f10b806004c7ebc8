"""Test-only hooks, active when this folder is on PYTHONPATH (Python imports `sitecustomize` at start).

AUDIT_WRITES_DIR=dir: each process appends the paths it writes (opens for writing, renames, removes)
to `<dir>/<RANK or 'launcher'>.<pid>.txt`. safetensors writes from Rust (no Python `open`), so its
`save_file` is wrapped too.

INJECT_FAULT=kind:rank:n[,n...]: on process RANK (`*` = all), at the n-th call of
`Accelerator.backward` (1-based, counted per process), `nan` multiplies the loss by NaN and `raise`
raises RuntimeError("injected failure").

SLOW_SAVE=seconds: `Accelerator.save_state` sleeps that long after writing its files, so a test can
kill a run reliably in the middle of a checkpoint. SLOW_EXPORT=seconds: the same for
`Accelerator.save_model` (the final export).

DUMP_PREPARED=dir: the first `Accelerator.prepare` call writes the models it is given, as main built
them (before any step, before feature statistics a fresh start computes after it), to
`<dir>/models.pt` (a list, in prepare order, of {"state": state_dict, "requires_grad": {name: flag}}),
then the process exits 0 at once: what tests/benchmarks/test_recipe.py compares with the seams.

ENOSPC_AT_SAVE=n: the n-th `Accelerator.save_state` call (1-based, per process) writes half a file,
then fails with OSError(ENOSPC) as a full disk would.

ENOSPC_AT_SAFETENSORS=n: the n-th safetensors file accelerate writes (per process: a checkpoint's or
the export's `model.safetensors`) gets 100 bytes, then safetensors' own error on a full disk
(SafetensorError, no OSError; its message as safetensors 0.8 gives it on a full tmpfs).

FORCE_FSDP_ON_CPU=1: a CPU run launched with an FSDP profile (ACCELERATE_USE_FSDP=true) becomes
`DistributedType.FSDP` with the profile's plugin, as it would on GPUs. Accelerate 1.15's
`AcceleratorState` turns the profile into FSDP only for accelerator device types (state.py, the
`elif self.distributed_type in [MULTI_GPU, ...]` branch); with `cpu=True` it stays MULTI_CPU (DDP).
Everything after that decision (prepare → fully_shard, clip_grad_norm_ on DTensors, sharded
save_state/load_state through torch.distributed.checkpoint, the full state dict for export) is
accelerate's and torch's own code, on gloo. The recipes accept FSDP on CPU only when accelerate
really made it FSDP, so without this hook the profile is still refused.

FORCE_DEEPSPEED_ON_CPU=1: the same for a DeepSpeed profile (ACCELERATE_USE_DEEPSPEED=true): the CPU run
becomes `DistributedType.DEEPSPEED` with the profile's plugin (accelerate 1.15 decides DEEPSPEED only
without cpu=True). With DS_ACCELERATOR=cpu, DeepSpeed's CPU accelerator uses the gloo group torch
formed; prepare → deepspeed.initialize, the engine's backward/step and save/load_checkpoint are
DeepSpeed's own code. Without the hook the profile is refused on CPU.

Production code has no fault-injection switches.
"""

import os
import sys

_dir = os.environ.get("AUDIT_WRITES_DIR")
if _dir:
    _log_path = os.path.join(_dir, f"{os.environ.get('RANK', 'launcher')}.{os.getpid()}.txt")
    _log = None
    _WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def _record(path):
        global _log
        path = os.path.abspath(os.fsdecode(path))
        if path.startswith(_dir) or path.startswith("/dev/") or path.startswith("/proc/"):
            return
        if _log is None:
            _log = open(_log_path, "a", buffering=1)  # the audit's own file is skipped above
        _log.write(path + "\n")

    def _hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            mode, flags = args[1], args[2]
            if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & _WRITE_FLAGS
            ):
                _record(args[0])
        elif event in ("os.rename", "shutil.rmtree", "os.remove"):  # replace() raises os.rename
            _record(args[0])

    sys.addaudithook(_hook)

    try:
        import safetensors.torch as _st

        _orig = _st.save_file

        def save_file(tensors, filename, *a, **k):
            _record(filename)
            return _orig(tensors, filename, *a, **k)

        _st.save_file = save_file
    except ImportError:
        pass


_fault = os.environ.get("INJECT_FAULT")
if _fault:
    _kind, _rank, _calls = _fault.split(":")
    _calls = {int(c) for c in _calls.split(",")}
    if _rank in ("*", os.environ.get("RANK", "0")):
        import accelerate

        _orig_backward = accelerate.Accelerator.backward
        _count = [0]

        def backward(self, loss, **kwargs):
            _count[0] += 1
            if _count[0] in _calls:
                if _kind == "raise":
                    raise RuntimeError("injected failure")
                loss = loss * float("nan")
            return _orig_backward(self, loss, **kwargs)

        accelerate.Accelerator.backward = backward


if os.environ.get("DUMP_PREPARED"):
    import accelerate

    def prepare_dump(self, *args, **kwargs):
        import torch

        models = [{"state": {k: v.detach().clone() for k, v in m.state_dict().items()},
                   "requires_grad": {n: p.requires_grad for n, p in m.named_parameters()}}
                  for m in args if isinstance(m, torch.nn.Module)]
        torch.save(models, os.path.join(os.environ["DUMP_PREPARED"], "models.pt"))
        os._exit(0)

    accelerate.Accelerator.prepare = prepare_dump


if os.environ.get("SLOW_SAVE"):
    import time

    import accelerate

    _orig_save_state = accelerate.Accelerator.save_state

    def save_state(self, *args, **kwargs):
        result = _orig_save_state(self, *args, **kwargs)
        time.sleep(float(os.environ["SLOW_SAVE"]))
        return result

    accelerate.Accelerator.save_state = save_state


if os.environ.get("SLOW_EXPORT"):
    import time

    import accelerate

    _orig_save_model = accelerate.Accelerator.save_model

    def save_model(self, *args, **kwargs):
        result = _orig_save_model(self, *args, **kwargs)
        time.sleep(float(os.environ["SLOW_EXPORT"]))
        return result

    accelerate.Accelerator.save_model = save_model


if os.environ.get("ENOSPC_AT_SAVE"):
    import errno

    import accelerate

    _orig_save_state_enospc = accelerate.Accelerator.save_state
    _saves = [0]

    def save_state_enospc(self, output_dir=None, *args, **kwargs):
        _saves[0] += 1
        if _saves[0] == int(os.environ["ENOSPC_AT_SAVE"]):
            with open(os.path.join(output_dir, "optimizer.bin"), "wb") as f:
                f.write(b"\0" * 4096)  # what was written before the disk filled up
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(output_dir, "optimizer.bin"))
        return _orig_save_state_enospc(self, output_dir, *args, **kwargs)

    accelerate.Accelerator.save_state = save_state_enospc


if os.environ.get("ENOSPC_AT_SAFETENSORS"):
    import accelerate.utils.other as _other
    from safetensors import SafetensorError

    _orig_safe_save_file = _other.safe_save_file
    _safetensors_writes = [0]

    def safe_save_file_enospc(tensors, filename, *args, **kwargs):
        _safetensors_writes[0] += 1
        if _safetensors_writes[0] == int(os.environ["ENOSPC_AT_SAFETENSORS"]):
            with open(filename, "wb") as f:
                f.write(b"\0" * 100)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return _orig_safe_save_file(tensors, filename, *args, **kwargs)

    _other.safe_save_file = safe_save_file_enospc


if os.environ.get("FORCE_FSDP_ON_CPU") == "1":
    import accelerate.state as _state

    _orig_state_init = _state.AcceleratorState.__init__

    def _state_init(self, mixed_precision=None, cpu=False, dynamo_plugin=None, deepspeed_plugin=None,
                    fsdp_plugin=None, *args, **kwargs):
        _orig_state_init(self, mixed_precision, cpu, dynamo_plugin, deepspeed_plugin, fsdp_plugin, *args, **kwargs)
        # What state.py does for MULTI_GPU when ACCELERATE_USE_FSDP is set, for the gloo (MULTI_CPU) group,
        # including its last line: PartialState says FSDP too (every later AcceleratorState() copies
        # PartialState's fields over its own, so without it the run would fall back to DDP mid-way).
        if (fsdp_plugin is not None and self.distributed_type == _state.DistributedType.MULTI_CPU
                and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"):
            self.distributed_type = _state.DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            _state.PartialState._shared_state["distributed_type"] = self.distributed_type

    _state.AcceleratorState.__init__ = _state_init


if os.environ.get("FORCE_DEEPSPEED_ON_CPU") == "1":
    import accelerate.state as _state

    _orig_state_init_ds = _state.AcceleratorState.__init__

    def _state_init_ds(self, mixed_precision=None, cpu=False, dynamo_plugin=None, deepspeed_plugin=None,
                       fsdp_plugin=None, *args, **kwargs):
        _orig_state_init_ds(self, mixed_precision, cpu, dynamo_plugin, deepspeed_plugin, fsdp_plugin, *args, **kwargs)
        # What state.py does when ACCELERATE_USE_DEEPSPEED is set without cpu=True (its `elif ... and not cpu`
        # branch, and PartialState's `use_deepspeed`), for the gloo (MULTI_CPU) group: DeepSpeed's CPU
        # accelerator (DS_ACCELERATOR=cpu) communicates over gloo, through the group torch already formed.
        if (deepspeed_plugin is not None and self.distributed_type == _state.DistributedType.MULTI_CPU
                and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"):
            self.distributed_type = _state.DistributedType.DEEPSPEED
            deepspeed_plugin.set_mixed_precision(self._mixed_precision)
            deepspeed_plugin.select(_from_accelerator_state=True)
            self.deepspeed_plugins = deepspeed_plugin
            self._mixed_precision = "no"  # DeepSpeed handles precision through its config
            _state.PartialState._shared_state["distributed_type"] = self.distributed_type

    _state.AcceleratorState.__init__ = _state_init_ds
