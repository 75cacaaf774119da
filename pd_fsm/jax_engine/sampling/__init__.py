"""Choosing the next token: a request's sampling parameters (``params``), the jitted sampler over
the logits (``sampler``) and grammar-constrained decoding (``grammar``).

Empty on purpose: ``params`` and ``grammar`` import no JAX, and importing them must not pull it in.
"""
