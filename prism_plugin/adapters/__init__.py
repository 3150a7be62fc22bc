"""Framework adapters: the only code that imports Megatron-core or DeepSpeed."""
