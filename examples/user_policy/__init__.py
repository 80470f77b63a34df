"""A failure policy defined outside distrain, chosen by config alone (distrain/cluster/policy.py)."""
