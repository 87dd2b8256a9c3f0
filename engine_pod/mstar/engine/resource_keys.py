"""The keys the engine registers its resources under, shared by the scheduler and model runner."""

KV = "kv"
ATTN = "attn"
ROPE = "rope"
SAMPLER = "sampler"
#: The only KV label our Llama-family models use.
LABEL = "main"
