"""Secondary tiers: the contract (`base`) and its backends: memory, fs, obj (S3)."""
