"""Every Iso-C flatten method and its parts: the registry and "auto" (registry.py), exact (LAPACK), polar, gram, fast
(+ its Gram route), their coefficients, rank certificates, 3xTF32 products, iteration statistics, and the buckets
that batch matrices by shape. Imports only the floor below it (reference, _validate, dispatch, triton)."""

from .registry import METHODS, Method, Registry, check_method, iso_flatten_impl, resolve_method

__all__ = ["METHODS", "Method", "Registry", "check_method", "iso_flatten_impl", "resolve_method"]
