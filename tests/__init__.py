"""Shared test helpers live in tests/ (assert_greedy_equal, tiny models)."""
