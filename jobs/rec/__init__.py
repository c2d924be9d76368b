"""DLRM-style click-through-rate job: synthetic or Criteo-format click logs, AUC and log-loss.

`config` is torch-free (the submit side imports it); everything else is job side.
"""
