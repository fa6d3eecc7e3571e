"""pagedkv: a distributed paged KV-cache service for LLM inference.

The roles are subpackages: `pagedkv.cache_node` (data plane), `pagedkv.coordinator`
(control plane), `pagedkv.client` (what workers import), `pagedkv.protos` (the contract).
"""

__version__ = "0.1.0"
