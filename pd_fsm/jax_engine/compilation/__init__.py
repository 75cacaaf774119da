"""Compiling a bounded set of executables ahead of time: shape buckets (``buckets``), the table of
compiled executables (``executables``), their store on disk (``executable_store``) and the
worker's on-by-default cache over it (``cache``)."""
