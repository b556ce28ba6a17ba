"""Helpers for writing env files (e.g. `math_grader` for math answers)."""
