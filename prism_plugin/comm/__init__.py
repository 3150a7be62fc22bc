"""The `prism` torch.distributed backend: virtual groups, data policies, timed work handles."""
