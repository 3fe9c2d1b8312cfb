"""Code every question of the study shares: its run records (records.py), the paired statistics of its gaps
(stats.py) and v3's tuning rule, the grid of outer configs per cell and its pick (grids.py)."""
