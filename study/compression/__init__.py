"""Does IsoLoCo's gain survive an 8-, 4- or 2-bit compressed exchange of the pseudo-gradients?"""
