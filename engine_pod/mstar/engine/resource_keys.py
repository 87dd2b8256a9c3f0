"""The keys the engine registers its resources under, shared by the scheduler and model runner."""

KV = "kv"
ATTN = "attn"
ROPE = "rope"
SAMPLER = "sampler"
