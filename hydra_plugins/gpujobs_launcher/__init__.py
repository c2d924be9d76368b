"""gpujobs' Hydra plugins: the sweep launcher and sweeper (`hydra/launcher=gpujobs`, `hydra/sweeper=gpujobs`)."""
