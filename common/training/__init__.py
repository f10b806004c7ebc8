"""The run and its guarantees: start, loop, checkpoints, processes, faults, logs (map: common/README.md)."""
