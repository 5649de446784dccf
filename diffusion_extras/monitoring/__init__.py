"""What a run measures about itself while it trains: per-timestep diagnostics, held-out loss,
gradient monitor, LR range test, debug images."""
