"""TODO(plan31): what this package holds."""
