"""Multi-node jobs: a job's members, one per node, and how each is launched (issue 33)."""
