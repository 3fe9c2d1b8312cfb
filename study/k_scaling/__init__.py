"""K at fixed compute: the horizon's tokens over more workers for fewer rounds (v6 C)."""
