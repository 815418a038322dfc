"""Test support shared across the suite (helpers that are not tests themselves)."""
