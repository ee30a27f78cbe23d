"""What every model and engine part shares: the ragged batch contract (``ForwardBatch``) and the
paged cache (block allocator, per-model pools, the request-to-slots table)."""
