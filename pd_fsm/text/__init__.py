"""Text in and out of the model: tokenizers, incremental detokenising and chat templates.

A layer of its own, below the engine: none of it imports JAX (or anything of pd_fsm), so what
handles requests as text needs no accelerator stack to do so.
"""
