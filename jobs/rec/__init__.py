"""DLRM-style click-through-rate job (DLRM, DLRM-DCNv2): synthetic or Criteo-format click logs, AUC and log-loss.

`config` and what it sizes with (`features`, `sizes`) are torch-free (the submit side imports them);
everything else is job side.
"""
