"""The outer-step core every outer optimizer stands on (IsoLoCo, MergeLoCo, ShardedIsoLoCo, the DTensor step): the
SGD-shaped constructor, settings and state (sgd_state.py), momentum (momentum.py), the step's shared checks and
bucketed flatten (core.py), N-D parameters (nd.py). Imports ops/flatten below it, never optim/ or distributed/."""
