"""When does the gain hold, and why: the init scale and the workers' divergence, H, K, a BPE vocabulary (v2)."""
