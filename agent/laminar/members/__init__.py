"""Multi-node jobs: a job's members on several nodes (docs/jobs.md)."""
