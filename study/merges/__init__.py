"""Which merge of the K workers' deltas helps DiLoCo? The paper's merges against the mean, each tuned (v5 B)."""
