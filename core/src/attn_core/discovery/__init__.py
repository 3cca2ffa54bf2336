"""Discovery: the registry of backends (entry points and pluggy), their probes, and selection by capability and
measured speed."""
