"""Where the data come from and how they are batched: folders, `datasets` sources, streams, the data check (map: common/README.md)."""
