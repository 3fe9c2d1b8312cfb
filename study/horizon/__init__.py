"""Does the gain hold at ~20 tokens per parameter, and what do outer-lr schedules change there? (v6 A, B)"""
