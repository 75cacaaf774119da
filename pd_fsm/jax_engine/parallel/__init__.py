"""More than one device: tensor parallelism within a process (``tensor_parallel``) and one
instance over several processes (``distributed``)."""
