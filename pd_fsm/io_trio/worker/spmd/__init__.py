"""One tensor-parallel instance over several processes: rank 0 serves and commands (``leader``),
the other ranks replay its scheduler (``follower``), over the frames of ``frames``."""
