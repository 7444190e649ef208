"""Adasum's algorithm across ranks, written once on the communicator interface: the contract tree,
VHDD, the fused buffers, the agreement before data moves, and Adasum of tensor lists across
processes."""
