"""What removed the gain at 16 x 128 bytes per worker step: tokens, sequence or the model's capacity? Depth (v5 A, C)."""
