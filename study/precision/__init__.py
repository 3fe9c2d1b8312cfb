"""How exact must the flatten be for training? Cheaper, looser and damaged flattens against the exact one (v4)."""
