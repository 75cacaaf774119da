"""The KV cache: the paged pool and its allocator (``pool``), the lock every forward and copy
takes (``holder``), the page copies between pools (``gather_scatter``, ``pallas_copy``,
``tiered``), a room's pages as the transfer sees them (``pool_spec``, ``room``), their checksum
(``checksum``) and the host heap policy large host-side KV buffers need (``host_memory``).

Empty on purpose: ``host_memory`` runs before JAX is imported (it may re-execute the process).
"""
