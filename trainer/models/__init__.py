"""Model families: the interface the stages call, the registry, and the attention kernels."""
