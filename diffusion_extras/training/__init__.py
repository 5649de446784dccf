"""The trainer: configuration, setup, the loop, checkpoints and resume, trackers, artifacts."""
