"""Cross-package tests. The example plugins under example_plugins/ are built and installed by
test_packaging.py; their own tests run inside that test's venv, never in this session."""

collect_ignore_glob = ["example_plugins/*"]
