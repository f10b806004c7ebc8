"""Model pieces the recipes share: the log-mel front end, the encoder, exports (map: common/README.md)."""
