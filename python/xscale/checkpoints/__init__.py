"""Checkpoints: when to save (cadence), where and how atomically (files), what a checkpoint
holds (contents), how a loop saves behind one interface (savers), the every-rank format
(every_rank, torch.distributed.checkpoint) and a DeepSpeed engine's own (engine);
docs/CHECKPOINTS.md."""
