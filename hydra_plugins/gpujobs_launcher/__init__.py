"""The gpujobs sweep launcher for Hydra (`hydra/launcher=gpujobs`, the default of gpujobs' config)."""
