"""serve_jax: LLM serving with a paged KV cache, a host tier and cascade-avoiding preemption."""
