"""Where metrics go besides the run dir, torch-free: the series trackers log, the MLflow client, a sweep's runs.

Both sides use it: the ranks log through `gpujobs.rank.observe.trackers`, the submit side makes a sweep's MLflow
runs before any point starts (`gpujobs.trackers.sweep`).
"""
