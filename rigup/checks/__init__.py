"""Checks: pure functions from facts and the plan to findings (preflight, fit, driver plan)."""
