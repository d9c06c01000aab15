"""Models: shapes and parameter counts from a config, loading and quantizing the base, LoRA, kernels, activation offload."""
