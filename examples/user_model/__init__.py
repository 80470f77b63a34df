"""A model defined outside distrain, trained by config alone (docs/models.md)."""
