"""The KV cache: its device layout, dense or paged, and the reads and writes of a forward pass
(kv_cache.py); the host's page allocator and the prefix cache of full, committed pages
(pages.py)."""
