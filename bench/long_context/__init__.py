"""Long sequences on one GPU: chunked drafter steps, flex attention's kernel options, FlashAttention-4."""
