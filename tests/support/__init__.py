"""What the tests share: helpers, fixtures and data, each module by subject (none is a test)."""
