"""The keys the engine registers its resources under, shared by the scheduler and model runner."""

KV = "kv"
ATTN = "attn"
ROPE = "rope"
SAMPLER = "sampler"
#: LoRA adapter slots; sorts before "kv", so it admits (and may refuse) before pages move
LORA = "adapter"
