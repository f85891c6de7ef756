"""The serving conformance check (issue 53): see __main__.py. Runs in .serving-venv (scripts/serving-check.sh);
attention.py, report.py and jobs.py need only torch and are tested in the main suite (tests/test_serving_check.py)."""
