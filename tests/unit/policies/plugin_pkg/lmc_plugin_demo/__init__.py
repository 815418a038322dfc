"""A throw-away third-party package that adds a policy through the entry point."""
