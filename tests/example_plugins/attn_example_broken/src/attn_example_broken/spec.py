"""Simulates a plugin whose spec needs something missing: importing it raises."""

raise ImportError("attn_example_broken needs libexample.so, which is not installed (simulated)")
