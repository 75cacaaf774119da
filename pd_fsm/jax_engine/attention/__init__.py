"""Attention over the paged KV pool for the fused step: pd_fsm's Pallas kernel and its XLA
reference."""
