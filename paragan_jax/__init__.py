"""paragan_jax: scalable GAN training in Flax NNX with synchronous and asynchronous G/D updates."""
