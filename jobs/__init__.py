"""Training jobs that gpujobs can run; each subpackage is one job (task, model, data)."""
