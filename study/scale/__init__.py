"""One point at a scale a CPU cannot reach: a ~100M model on a lent GPU (v6 D)."""
